// Routed experts of an MoE block on CPU for decode-sized batches (the contract of
// vllm_glm53/backends/cpu/moe.py, whose routed_experts_torch is the reference):
//
//   out[t] = sum_j weights[t, j] * W2_e( silu(min(g, L)) * clamp(u, -L, L) ),  [g | u] = W13_e x[t],  e = ids[t, j]
//
// With a few tokens per expert every weight row is used by a handful of dot products, so the work is bound by
// streaming the used experts' weights from memory once. The (token, choice) pairs are grouped by expert here,
// then three steps, each one parallel region:
//   1. tasks (expert, block of intermediate rows): each gate row and its up row are read once and dotted with
//      every token routed to the expert (their float32 rows stay in cache), giving h [pairs, I] float32;
//   2. tasks (expert, block of hidden rows) of W2 the same way, giving one output row per pair, y [pairs, D];
//   3. per token, its k pair outputs weighted and summed in choice order (deterministic, no atomics).
// Experts that received no token are never touched. Rows go two at a time against kTok tokens at a time (4 with
// AVX-512, 2 with 16 vector registers), so each loaded lane group of a weight row feeds kTok FMAs and 2 * kTok
// accumulators hide the FMA latency without spilling; the next
// rows are prefetched meanwhile (the loads alone kept too few misses in flight: ~1.4x the memory floor at 16
// tokens without, ~1.2x with). With many tokens an expert's tokens go in chunks whose rows fit in L2; there the
// kernel is compute-bound and the Python side hands large batches to torch's GEMMs.

#include <vector>

#include "common.h"

namespace glm53 {
namespace {

// Tokens sharing each load of a weight row: 2 rows x kTok tokens of accumulators in registers (vec.h).
constexpr int kTok = kVectorRegs >= 32 ? 4 : 2;
constexpr int64_t kRowsPerTask = 16;  // weight rows (gate/up pairs in step 1) per task
constexpr int64_t kAhead = 1;         // prefetch distance in row pairs
constexpr int64_t kChunkBytes = 128 << 10;  // float32 token rows a task works through per pass over its rows

// Tokens per pass over a block of weight rows, so their ``len``-float rows stay in L2 across the block.
int64_t token_chunk(int64_t len) {
  return std::max<int64_t>(kTok, kChunkBytes / (4 * std::max<int64_t>(len, 1)) / kTok * kTok);
}

// acc[r][j] = dot(rows[r], xs[j]) over len values for R rows and N tokens (float32 sums). ``ahead`` (or null):
// R rows to prefetch meanwhile, the ones the caller reads next.
template <int R, int N, typename W>
inline void dot_block(const W* const* rows, const W* const* ahead, const float* const* xs, int64_t len,
                      float (*acc)[kTok]) {
  F16 s[R][N];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) s[r][j] = zero();
  for (int64_t i = 0; i < len; i += kLanes) {
    const int m = static_cast<int>(std::min<int64_t>(kLanes, len - i));
    if (ahead != nullptr)
      for (int r = 0; r < R; ++r) __builtin_prefetch(ahead[r] + i);
    F16 w[R];
    for (int r = 0; r < R; ++r) w[r] = load(rows[r] + i, m);
    for (int j = 0; j < N; ++j) {
      const F16 xv = load(xs[j] + i, m);
      for (int r = 0; r < R; ++r) s[r][j] = fma(w[r], xv, s[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) acc[r][j] = reduce_add(s[r][j]);
}

// The same for 1..N tokens (n picks the instantiation).
template <int R, int N = kTok, typename W>
inline void dot_tokens(const W* const* rows, const W* const* ahead, const float* const* xs, int n, int64_t len,
                       float (*acc)[kTok]) {
  if constexpr (N > 1)
    if (n < N) return dot_tokens<R, N - 1>(rows, ahead, xs, n, len, acc);
  dot_block<R, N>(rows, ahead, xs, len, acc);
}

// The clamped SwiGLU of one gate / up value (only the gate's upper side is clamped).
inline float clamped_swiglu(float g, float u, float limit) {
  return silu(std::min(g, limit)) * std::clamp(u, -limit, limit);
}

struct Task {
  int64_t expert, row0, rows;
};

// (expert, block of ``n_rows`` rows) for every expert with tokens.
std::vector<Task> expert_tasks(const std::vector<int64_t>& count, int64_t n_rows) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e < static_cast<int64_t>(count.size()); ++e) {
    if (count[e] == 0) continue;
    for (int64_t r = 0; r < n_rows; r += kRowsPerTask) tasks.push_back({e, r, std::min(kRowsPerTask, n_rows - r)});
  }
  return tasks;
}

at::Tensor rows_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

}  // namespace

// x [T, D] (float32 / bf16 / fp16), w13 [E, 2I, D] (rows: I gate, then I up), w2 [E, D, I] (w13's dtype, any
// of the three), ids [T, k] int32 / int64 in [0, E), weights [T, k] -> out [T, D] float32.
at::Tensor moe_experts(const at::Tensor& x_, const at::Tensor& w13_, const at::Tensor& w2_, const at::Tensor& ids_,
                       const at::Tensor& weights_, double swiglu_limit) {
  TORCH_CHECK(x_.dim() == 2 && w13_.dim() == 3 && w2_.dim() == 3,
              "moe_experts: x [T, D], w13 [E, 2I, D], w2 [E, D, I]");
  const int64_t T = x_.size(0), D = x_.size(1), E = w13_.size(0), I = w13_.size(1) / 2;
  TORCH_CHECK(w13_.size(1) == 2 * I && w13_.size(2) == D, "moe_experts: w13 must be [E, 2I, ", D, "], got ",
              w13_.sizes());
  TORCH_CHECK(w2_.size(0) == E && w2_.size(1) == D && w2_.size(2) == I, "moe_experts: w2 must be [", E, ", ", D,
              ", ", I, "], got ", w2_.sizes());
  TORCH_CHECK(w13_.scalar_type() == w2_.scalar_type(), "moe_experts: w13 and w2 dtypes differ");
  TORCH_CHECK(ids_.dim() == 2 && ids_.size(0) == T && weights_.sizes() == ids_.sizes(),
              "moe_experts: ids and weights must be [T, k]");
  TORCH_CHECK(!ids_.is_floating_point(), "moe_experts: ids must be integers");
  for (const at::Tensor* t : {&x_, &w13_, &w2_, &ids_, &weights_})
    TORCH_CHECK(t->device().is_cpu(), "moe_experts: tensors must be on the CPU");
  const int64_t k = ids_.size(1), P = T * k;
  if (P == 0 || D == 0) return at::zeros({T, D}, x_.options().dtype(at::kFloat));
  at::Tensor out = at::empty({T, D}, x_.options().dtype(at::kFloat));

  // Tokens in float32 (the dot products read them from cache many times), routing on the host side.
  at::Tensor x = x_.to(at::kFloat).contiguous();
  at::Tensor ids = ids_.to(at::kLong).contiguous(), weights = weights_.to(at::kFloat).contiguous();
  at::Tensor w13 = rows_contiguous(w13_), w2 = rows_contiguous(w2_);
  const float limit = static_cast<float>(swiglu_limit);

  // Group the pairs by expert, in token order within an expert: slot[p] is pair p's row in h and y.
  const int64_t* idp = ids.data_ptr<int64_t>();
  std::vector<int64_t> count(E, 0), start(E + 1, 0), slot(P), token_at(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(idp[p] >= 0 && idp[p] < E, "moe_experts: expert id ", idp[p], " outside [0, ", E, ")");
    ++count[idp[p]];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + count[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < P; ++p) {
      slot[p] = fill[idp[p]]++;
      token_at[slot[p]] = p / k;
    }
  }
  at::Tensor h = at::empty({P, I}, out.options()), y = at::empty({P, D}, out.options());
  const float* xp = x.data_ptr<float>();
  const int64_t x_chunk = token_chunk(D), h_chunk = token_chunk(I);
  float *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>();

  GLM53_DISPATCH_FLOAT_TYPES(w13.scalar_type(), "moe_experts weights", [&] {
    const scalar_t* w13p = w13.data_ptr<scalar_t>();
    const scalar_t* w2p = w2.data_ptr<scalar_t>();
    const int64_t s13e = w13.stride(0), s13r = w13.stride(1), s2e = w2.stride(0), s2r = w2.stride(1);

    // 1. h = clamped_swiglu(W13_e x) for each expert's tokens, a block of intermediate rows per task.
    const std::vector<Task> up_tasks = expert_tasks(count, I);
    at::parallel_for(0, static_cast<int64_t>(up_tasks.size()), 1, [&](int64_t b, int64_t end) {
      float acc[2][kTok];
      const float* xs[kTok];
      for (; b < end; ++b) {
        const Task& task = up_tasks[b];
        const scalar_t* we = w13p + task.expert * s13e;
        for (int64_t c0 = start[task.expert]; c0 < start[task.expert + 1]; c0 += x_chunk) {
          const int64_t c1 = std::min(c0 + x_chunk, start[task.expert + 1]);
          for (int64_t r = task.row0; r < task.row0 + task.rows; ++r) {
            const scalar_t* rows[2] = {we + r * s13r, we + (I + r) * s13r};
            const int64_t rn = std::min(r + kAhead, I - 1);
            const scalar_t* next[2] = {we + rn * s13r, we + (I + rn) * s13r};
            for (int64_t j0 = c0; j0 < c1; j0 += kTok) {
              const int n = static_cast<int>(std::min<int64_t>(kTok, c1 - j0));
              for (int j = 0; j < n; ++j) xs[j] = xp + token_at[j0 + j] * D;
              dot_tokens<2>(rows, j0 == c0 ? next : nullptr, xs, n, D, acc);
              for (int j = 0; j < n; ++j) hp[(j0 + j) * I + r] = clamped_swiglu(acc[0][j], acc[1][j], limit);
            }
          }
        }
      }
    });

    // 2. y = W2_e h for each expert's pairs, a block of hidden rows per task (rows two at a time, an odd last one).
    const std::vector<Task> down_tasks = expert_tasks(count, D);
    at::parallel_for(0, static_cast<int64_t>(down_tasks.size()), 1, [&](int64_t b, int64_t end) {
      float acc[2][kTok];
      const float* hs[kTok];
      for (; b < end; ++b) {
        const Task& task = down_tasks[b];
        const scalar_t* we = w2p + task.expert * s2e;
        for (int64_t c0 = start[task.expert]; c0 < start[task.expert + 1]; c0 += h_chunk) {
          const int64_t c1 = std::min(c0 + h_chunk, start[task.expert + 1]);
          for (int64_t r = task.row0; r < task.row0 + task.rows; r += 2) {
            const int nr = static_cast<int>(std::min<int64_t>(2, task.row0 + task.rows - r));
            const scalar_t* rows[2] = {we + r * s2r, we + (r + nr - 1) * s2r};
            const int64_t rn = std::min(r + 2 * kAhead, D - 2);
            const scalar_t* next[2] = {we + rn * s2r, we + (rn + 1) * s2r};
            for (int64_t j0 = c0; j0 < c1; j0 += kTok) {
              const int n = static_cast<int>(std::min<int64_t>(kTok, c1 - j0));
              for (int j = 0; j < n; ++j) hs[j] = hp + (j0 + j) * I;
              const scalar_t* const* pf = j0 == c0 && rn >= 0 ? next : nullptr;
              if (nr == 2) dot_tokens<2>(rows, pf, hs, n, I, acc);
              else dot_tokens<1>(rows, pf, hs, n, I, acc);
              for (int j = 0; j < n; ++j)
                for (int i = 0; i < nr; ++i) yp[(j0 + j) * D + r + i] = acc[i][j];
            }
          }
        }
      }
    });
  });

  // 3. out[t] = sum_j weights[t, j] y[slot of (t, j)], in choice order.
  const float* wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / (k * D)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* ot = op + t * D;
      for (int64_t d = 0; d < D; d += kLanes) {
        const int m = static_cast<int>(std::min<int64_t>(kLanes, D - d));
        F16 acc = zero();
        for (int64_t j = 0; j < k; ++j) acc = fma(set1(wp[t * k + j]), load(yp + slot[t * k + j] * D + d, m), acc);
        store(ot + d, acc, m);
      }
    }
  });
  return out;
}

}  // namespace glm53
