// Routed experts of an MoE block on CPU (the contract of vllm_glm53/backends/cpu/moe.py, whose
// routed_experts_torch is the reference):
//
//   out[t] = sum_j weights[t, j] * W2_e( silu(min(g, L)) * clamp(u, -L, L) ),  [g | u] = W13_e x[t],  e = ids[t, j]
//
// The (token, choice) pairs are grouped by expert here, then three steps, each one parallel region:
//   1. tasks (expert, block of intermediate rows): each gate row and its up row are read once and multiplied with
//      every token routed to the expert, giving h (float32, rounded to the tokens' dtype where that is 16-bit:
//      as_h);
//   2. tasks (expert, block of hidden rows) of W2 the same way, giving one output row per pair, y [pairs, D];
//   3. per token, its k pair outputs weighted and summed in choice order (deterministic, no atomics).
// Experts that received no token are never touched. How an expert's rows meet its tokens depends on their number:
//   - fewer than kAcrossLanesMinTokens: gemv.h's dot products (rows two at a time against kTok tokens at a time,
//     the token rows staying in cache; h [pairs, I]). With a few tokens the work is bound by streaming the used
//     experts' weights once; the next rows are prefetched meanwhile (the loads alone kept too few misses in
//     flight: ~1.4x the memory floor at 16 tokens without, ~1.2x with);
//   - from there the tile path (gemv.h's row_tile_by_tokens, as linear.cpp's): the expert's tokens across the
//     vector lanes, a few rows at a time widened into an L1-resident float32 buffer and broadcast against them,
//     no horizontal sums; step 1 writes h in that layout for step 2. For FP8 rows and bfloat16 tokens on a CPU with
//     bfloat16 dot products, both steps multiply bfloat16 pairs (gemv.h), on AMX tiles where the CPU has them
//     (amx.h), which takes experts with 3 or more tokens (6 below a hidden size of 4,096) to the tile path (gemv.h's
//     pairs_direct_max).
//   - bfloat16 weights and tokens on a CPU with AMX tiles, from kAmxExpertMinPairs pairs per used expert: every
//     expert on the tiles, the weight rows loaded as they lie (experts_bf16_amx).
//
// moe_experts_fp8 is the same computation on block-FP8 weights kept as E4M3 bytes. Below kAcrossLanesMinTokens
// it has two forms: at most kE4m3DirectMaxTokens tokens, the direct path (tokens pre-multiplied by the row block's
// scales, E4M3 rows converted as they stream; on avx2 up to 28 tokens, one token with the scales on the sums
// instead (gemv.h's task_quads: a gate row and its up row share the token), with bfloat16 pairs in both steps up to
// kPairsDirectMaxTokens, past kAcrossLanesMinTokens too); more (only where the direct path stops below
// kAcrossLanesMinTokens: the portable build's 5-6 tokens), each row dequantized into L1 and dotted with kTok tokens
// at a time. The tile path dequantizes its rows. It serves every batch size, prefill included: there is no
// dequantized copy for torch's GEMMs to use.

#include <algorithm>
#include <cstring>
#include <vector>

#include "gemv.h"

namespace glm53 {
namespace {

// The clamped SwiGLU of 16 gate / up values (only the gate's upper side is clamped): silu(min(g, L)) * clamp(u, -L,
// L), with vec.h's exp. Every path takes it 16 values at a time: libm's exp once per value took ~20 % of a call at
// hidden 512 (short rows: few products per h value) and about half of the AMX path's at 16 tokens.
inline F16 clamped_swiglu(F16 g, F16 u, float limit) {
  const F16 hi = set1(limit);
  g = vmin(hi, g);  // std::min(g, limit): a NaN gate stays NaN
  u = vmax(set1(-limit), vmin(hi, u));
  return g / (set1(1.0f) + exp(zero() - g)) * u;
}

// h as the model's dtype holds it: with bfloat16 / float16 tokens the intermediate is rounded to that dtype (to
// nearest even) before the down product, as it is a 16-bit tensor in the per-expert torch loop
// (routed_experts_torch, which runs the larger batches), in transformers' experts and in vLLM's fused MoE; float32
// tokens keep it float32. So the result does not depend on which path a batch size takes.
inline F16 as_h(at::ScalarType type, F16 v) {
  if (type == at::kBFloat16) {
    alignas(64) c10::BFloat16 b[kLanes];
    store(b, v);
    return glm53::load(b);  // qualified: c10::load is found by argument lookup
  }
  if (type == at::kHalf) {
    alignas(64) c10::Half b[kLanes];
    store(b, v);
    return glm53::load(b);
  }
  return v;
}

// A task's gate and up sums (its at most kRowsPerTask rows, one vector, for up to kMax tokens), kept until its rows
// are done so that the SwiGLU takes a token's 16 rows at once.
template <int64_t kMax>
struct TaskSums {
  static_assert(kRowsPerTask == kLanes, "a task's rows are one vector");
  alignas(64) float gate[kMax][kLanes], up[kMax][kLanes];
  // row i's sums of tokens [j0, j0 + n)
  void put(int64_t i, int64_t j0, int n, const float* g, const float* u) {
    for (int j = 0; j < n; ++j) gate[j0 + j][i] = g[j], up[j0 + j][i] = u[j];
  }
  // put(j, h) with h = clamped_swiglu of token j's first ``rows`` rows (0 past them), for tokens [0, n)
  template <typename Put>
  void swiglu(int64_t n, int64_t rows, float limit, const Put& put) const {
    const int m = static_cast<int>(rows);
    for (int64_t j = 0; j < n; ++j) put(j, clamped_swiglu(load(gate[j], m), load(up[j], m), limit));
  }
};

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

// The (token, choice) pairs grouped by expert, in token order within an expert: slot[p] is pair p's row in h and
// y, token_at[s] the token of slot s; experts own slots [start[e], start[e + 1]).
struct Routing {
  int64_t T, D, E, k, P;
  at::ScalarType h_type;  // what h is rounded to (as_h)
  at::Tensor x, weights;  // float32 token rows (the dot products read them from cache many times), weights [T, k]
  std::vector<int64_t> count, start, slot, token_at;
};

// The checks every expert op shares and the grouping. w13 [E, 2I, D], w2 [E, D, I] by shape only.
Routing route_pairs(const char* what, const at::Tensor& x_, const at::Tensor& w13, const at::Tensor& w2,
                    const at::Tensor& ids_, const at::Tensor& weights_) {
  TORCH_CHECK(x_.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, what, ": x [T, D], w13 [E, 2I, D], w2 [E, D, I]");
  const int64_t T = x_.size(0), D = x_.size(1), E = w13.size(0), I = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == D, what, ": w13 must be [E, 2I, ", D, "], got ", w13.sizes());
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == D && w2.size(2) == I, what, ": w2 must be [", E, ", ", D, ", ", I,
              "], got ", w2.sizes());
  TORCH_CHECK(ids_.dim() == 2 && ids_.size(0) == T && weights_.sizes() == ids_.sizes(), what,
              ": ids and weights must be [T, k]");
  TORCH_CHECK(!ids_.is_floating_point(), what, ": ids must be integers");
  for (const at::Tensor* t : {&x_, &w13, &w2, &ids_, &weights_})
    TORCH_CHECK(t->device().is_cpu(), what, ": tensors must be on the CPU");
  Routing g;
  g.T = T, g.D = D, g.E = E, g.k = ids_.size(1), g.P = T * g.k;
  g.h_type = x_.scalar_type() == at::kBFloat16 || x_.scalar_type() == at::kHalf ? x_.scalar_type() : at::kFloat;
  g.x = x_.to(at::kFloat).contiguous();
  g.weights = weights_.to(at::kFloat).contiguous();
  const at::Tensor ids = ids_.to(at::kLong).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  g.count.assign(E, 0), g.start.assign(E + 1, 0), g.slot.resize(g.P), g.token_at.resize(g.P);
  for (int64_t p = 0; p < g.P; ++p) {
    TORCH_CHECK(idp[p] >= 0 && idp[p] < E, what, ": expert id ", idp[p], " outside [0, ", E, ")");
    ++g.count[idp[p]];
  }
  for (int64_t e = 0; e < E; ++e) g.start[e + 1] = g.start[e] + g.count[e];
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  for (int64_t p = 0; p < g.P; ++p) {
    g.slot[p] = fill[idp[p]]++;
    g.token_at[g.slot[p]] = p / g.k;
  }
  return g;
}

// 3. out[t] = sum_j weights[t, j] y[slot of (t, j)], in choice order.
at::Tensor combine_pairs(const Routing& g, const at::Tensor& y) {
  at::Tensor out = at::empty({g.T, g.D}, g.x.options());
  const float* wp = g.weights.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t k = g.k, D = g.D;
  at::parallel_for(0, g.T, std::max<int64_t>(1, 16384 / (k * D)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* ot = op + t * D;
      for (int64_t d = 0; d < D; d += kLanes) {
        const int m = static_cast<int>(std::min<int64_t>(kLanes, D - d));
        F16 acc = zero();
        for (int64_t j = 0; j < k; ++j) acc = fma(set1(wp[t * k + j]), load(yp + g.slot[t * k + j] * D + d, m), acc);
        store(ot + d, acc, m);
      }
    }
  });
  return out;
}

// The experts that take the tile path (at least kAcrossLanesMinTokens tokens) and their tokens across the lanes
// (gemv.h): x for step 1 and h, which step 1 writes for step 2, each as float32 or as bfloat16 pairs in unpack order
// (``x_pairs``, ``h_pairs``: the orders, for bfloat16 row tiles). Expert e's token groups are [group0[e],
// group0[e + 1]); a token row of a group holds D or I values, or its order's len. Both buffers are left
// uninitialized but for h pairs with padding: the layout functions write every value of xt (zeros past the last
// token and in the padding) and step 1 every value of ht but the padding's (a prefill's buffers are hundreds of MB,
// zeroing them first was a second pass).
struct AcrossLanes {
  std::vector<int64_t> group0;
  at::Tensor xt, ht;
  const float* x_of(int64_t e, int64_t D) const { return xt.data_ptr<float>() + group0[e] * D * kLanes; }
  uint32_t* pairs_of(int64_t e, int64_t len) const { return pairs(xt) + group0[e] * len / 2 * kLanes; }
  float* h_of(int64_t e, int64_t I) { return ht.data_ptr<float>() + group0[e] * I * kLanes; }
  uint32_t* h_pairs_of(int64_t e, int64_t len) const { return pairs(ht) + group0[e] * len / 2 * kLanes; }
  int64_t groups(int64_t e) const { return group0[e + 1] - group0[e]; }
  static uint32_t* pairs(const at::Tensor& t) { return reinterpret_cast<uint32_t*>(t.data_ptr<int32_t>()); }
};

AcrossLanes tile_tokens(const Routing& g, int64_t I, int64_t min_tokens = kAcrossLanesMinTokens,
                        const UnpackOrder* x_pairs = nullptr, const UnpackOrder* h_pairs = nullptr) {
  AcrossLanes a;
  a.group0.assign(g.E + 1, 0);
  for (int64_t e = 0; e < g.E; ++e)
    a.group0[e + 1] = a.group0[e] + (g.count[e] >= min_tokens ? ceil_div(g.count[e], kLanes) : 0);
  const int64_t groups = a.group0[g.E];
  a.xt = x_pairs != nullptr ? at::empty({groups * x_pairs->len / 2 * kLanes}, g.x.options().dtype(at::kInt))
                            : at::empty({groups * g.D * kLanes}, g.x.options());
  a.ht = h_pairs == nullptr   ? at::empty({groups * I * kLanes}, g.x.options())
         : h_pairs->padded() ? at::zeros({groups * h_pairs->len / 2 * kLanes}, g.x.options().dtype(at::kInt))
                             : at::empty({groups * h_pairs->len / 2 * kLanes}, g.x.options().dtype(at::kInt));
  if (groups == 0) return a;  // no expert takes the tile path (decode with many experts): nothing to lay out
  const std::vector<int64_t> x_at = x_pairs != nullptr ? x_pairs->positions() : std::vector<int64_t>();
  const float* xp = g.x.data_ptr<float>();
  at::parallel_for(0, g.E, 1, [&](int64_t e, int64_t end) {
    for (; e < end; ++e) {
      if (a.groups(e) == 0) continue;
      const auto row = [&](int64_t j) { return xp + g.token_at[g.start[e] + j] * g.D; };
#if GLM53_AVX512
      if (x_pairs != nullptr) {
        token_pairs_across_lanes(row, g.count[e], *x_pairs, x_at.data(), a.pairs_of(e, x_pairs->len));
        continue;
      }
#endif
      tokens_across_lanes(row, g.count[e], g.D, a.xt.data_ptr<float>() + a.group0[e] * g.D * kLanes);
    }
  });
  return a;
}

// Step 1 on the tile path, rows [row0, last) of one expert: gate and up rows (row(up, r): the row's bytes, ``elem``
// a value; widen(up, r, k0, n, out): its columns [k0, k0 + n) into the tile) against the expert's ``groups`` token
// groups xe, kTilePassGroups per pass; put(group, r, h) stores row r of h for the kLanes tokens of a group (the
// lanes past the last token get clamped_swiglu(0, 0) = 0). Float32 tiles hold kRowTile / 2 gate rows and the same
// up rows; bfloat16 tiles (token pairs, gemv.h) hold kRowTile gate rows, then kRowTile up rows, since each tile
// takes one row block's scales (scales(up): the gate's or the up block row's). tile: kRowTile x tile_stride
// values, acc: kTilePassGroups x kRowTile x kLanes floats (twice that for bfloat16 tiles).
template <typename Tile, typename Tokens, typename Row, typename Widen, typename Scales, typename Put>
void swiglu_tile(int64_t row0, int64_t last, const Row& row, int64_t elem, const Widen& widen, const Scales& scales,
                 const Tokens* xe, int64_t groups, int64_t D, int64_t chunk, float limit, const Put& put, Tile* tile,
                 float* acc) {
  constexpr bool separate = !std::is_same_v<Tile, float>;
  constexpr int gate_rows = separate ? kRowTile : std::max(1, kRowTile / 2);
  constexpr int64_t cols = separate ? 2 : 1;  // token columns per 32-bit lane of xe
  float* acc_up = separate ? acc + kTilePassGroups * kRowTile * kLanes : acc;
  for (int64_t p0 = 0; p0 < groups; p0 += kTilePassGroups) {
    const int64_t pg = std::min(kTilePassGroups, groups - p0);
    const Tokens* xp = xe + p0 * tile_token_len<Tile>(D, chunk) / cols * kLanes;
    for (int64_t r0 = row0; r0 < last; r0 += gate_rows) {
      const int nh = static_cast<int>(std::min<int64_t>(gate_rows, last - r0));
      const int nn = static_cast<int>(std::clamp<int64_t>(last - r0 - gate_rows, 0, gate_rows));
      const char* gate[kRowTile];
      const char* up[kRowTile];
      const char* next[2 * kRowTile];
      for (int i = 0; i < nh; ++i) gate[i] = row(false, r0 + i), up[i] = row(true, r0 + i);
      for (int i = 0; i < nn; ++i)
        next[i] = row(false, r0 + gate_rows + i), next[nn + i] = row(true, r0 + gate_rows + i);
      int up_at = nh;  // where row i's up sums are: acc_up + (q * kRowTile + up_at + i) * kLanes
      if constexpr (separate) {
        row_tile_by_tokens(
            nh, [&](int i, int64_t k0, int64_t n, Tile* out) { widen(false, r0 + i, k0, n, out); }, gate, up, nh,
            elem, xp, scales(false), pg, D, chunk, tile, acc);
        row_tile_by_tokens(
            nh, [&](int i, int64_t k0, int64_t n, Tile* out) { widen(true, r0 + i, k0, n, out); }, up, next, nn,
            elem, xp, scales(true), pg, D, chunk, tile, acc_up);
        up_at = 0;
      } else {
        const char* both[kRowTile];
        for (int i = 0; i < nh; ++i) both[i] = gate[i], both[nh + i] = up[i];
        row_tile_by_tokens(
            2 * nh, [&](int i, int64_t k0, int64_t n, Tile* out) { widen(i >= nh, r0 + i % nh, k0, n, out); }, both,
            next, 2 * nn, elem, xp, nullptr, pg, D, chunk, tile, acc);
      }
      for (int64_t q = 0; q < pg; ++q)
        for (int i = 0; i < nh; ++i) {
          const float* ag = acc + (q * kRowTile + i) * kLanes;
          const float* au = acc_up + (q * kRowTile + up_at + i) * kLanes;
          alignas(64) float h[kLanes];
          store(h, clamped_swiglu(load(ag), load(au), limit));
          put(p0 + q, r0 + i, h);
        }
    }
  }
}

// swiglu_tile's put for float32 h across the lanes (he: an expert's first group), rounded as as_h says.
inline auto h_lanes(float* he, int64_t I, at::ScalarType type) {
  return [=](int64_t group, int64_t r, const float* h) {
    store(he + (group * I + r) * kLanes, as_h(type, load(h)));
  };
}

// The same for bfloat16 tiles in step 2: h as bfloat16 pairs across the lanes (token_pairs_across_lanes' layout, a
// token row ``len`` values in unpack order), column r at position at[r] (even for even r), the low (even r) or high
// half of pair at[r] / 2. A task's rows start even, so it writes both halves.
inline auto h_pairs(uint32_t* he, int64_t len, const int64_t* at) {
  return [=](int64_t group, int64_t r, const float* h) {
    char* dst = reinterpret_cast<char*>(he + (group * len / 2 + at[r] / 2) * kLanes) + (r % 2) * 2;
    alignas(64) c10::BFloat16 b[kLanes];
    store(b, load(h));
    for (int l = 0; l < kLanes; ++l) std::memcpy(dst + 4 * l, &b[l], sizeof(b[l]));
  };
}

// Step 2 on the tile path, rows [row0, last) of one expert's W2 (row(r), widen(r, k0, n, out) as above): kRowTile
// rows at a time against its h groups he (``tokens`` tokens; float32, or bfloat16 pairs for bfloat16 tiles, which
// take the row block's scales ``block_scales``), into y's rows ye[j * D + r].
template <typename Tile, typename Tokens, typename Row, typename Widen>
void down_tile(int64_t row0, int64_t last, const Row& row, int64_t elem, const Widen& widen,
               const float* block_scales, const Tokens* he, int64_t tokens, int64_t I, int64_t D, int64_t chunk,
               float* ye, Tile* tile, float* acc) {
  constexpr int64_t cols = std::is_same_v<Tile, float> ? 1 : 2;  // h columns per 32-bit lane of he
  const int64_t groups = ceil_div(tokens, kLanes), len = tile_token_len<Tile>(I, chunk) / cols;
  for (int64_t p0 = 0; p0 < groups; p0 += kTilePassGroups) {
    const int64_t pg = std::min(kTilePassGroups, groups - p0);
    for (int64_t r0 = row0; r0 < last; r0 += kRowTile) {
      const int nr = static_cast<int>(std::min<int64_t>(kRowTile, last - r0));
      const int nn = static_cast<int>(std::clamp<int64_t>(last - r0 - kRowTile, 0, kRowTile));
      const char* here[kRowTile];
      const char* next[kRowTile];
      for (int i = 0; i < nr; ++i) here[i] = row(r0 + i);
      for (int i = 0; i < nn; ++i) next[i] = row(r0 + kRowTile + i);
      row_tile_by_tokens(
          nr, [&](int i, int64_t k0, int64_t n, Tile* out) { widen(r0 + i, k0, n, out); }, here, next, nn, elem,
          he + p0 * len * kLanes, block_scales, pg, I, chunk, tile, acc);
      for (int64_t q = 0; q < pg; ++q) {
        const int64_t j0 = (p0 + q) * kLanes, n = std::min<int64_t>(kLanes, tokens - j0);
        store_tile_columns(reinterpret_cast<const float(*)[kLanes]>(acc + q * kRowTile * kLanes), nr, n,
                           ye + j0 * D + r0, D);
      }
    }
  }
}

#if GLM53_HAS_AMX
// Mean (token, choice) pairs per used expert from which bfloat16 experts run on AMX tiles. With fewer the dot
// products read the weights about as fast as the tiles do (warm, one core: 0.86x the tiles' time at 1 token an
// expert, 0.85-0.93x at 4); cold, 2 threads, AMX's time / the dot products': 0.94 / 0.50 / 0.42 at 4 / 8 / 16 pairs
// (64 experts, hidden 512), 0.68 / 0.58 / 0.47 (16 experts of the released size).
constexpr int64_t kAmxExpertMinPairs = 4;

// Steps 1 and 2 for bfloat16 weights and tokens on AMX tiles (amx.h), every expert with tokens, any count: the
// weight rows are loaded into the tiles as they lie in memory (nothing to convert), against the expert's tokens 16 at
// a time as column pairs (token_pairs_in_order); step 1 writes h (bfloat16, as as_h rounds it) in that layout for
// step 2. Returns y [P, D]. D and I multiples of 32 (a tile row's 32 columns).
at::Tensor experts_bf16_amx(const Routing& g, const at::Tensor& w13, const at::Tensor& w2, int64_t I, float limit) {
  const int64_t D = g.D, E = g.E, Dp = D / 2, Ip = I / 2;
  std::vector<int64_t> group0(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) group0[e + 1] = group0[e] + ceil_div(g.count[e], kLanes);
  const auto ints = g.x.options().dtype(at::kInt);
  const at::Tensor xt = at::empty({group0[E] * Dp * kLanes}, ints), ht = at::empty({group0[E] * Ip * kLanes}, ints);
  uint32_t* xtp = reinterpret_cast<uint32_t*>(xt.data_ptr<int32_t>());
  uint32_t* htp32 = reinterpret_cast<uint32_t*>(ht.data_ptr<int32_t>());
  const float* xp = g.x.data_ptr<float>();
  at::parallel_for(0, E, 1, [&](int64_t e, int64_t end) {
    for (; e < end; ++e)
      if (g.count[e] > 0)
        token_pairs_in_order([&](int64_t j) { return xp + g.token_at[g.start[e] + j] * D; }, g.count[e], D,
                             xtp + group0[e] * Dp * kLanes);
  });
  at::Tensor y = at::empty({g.P, D}, g.x.options());
  float* yp = y.data_ptr<float>();
  const auto* w13p = w13.data_ptr<c10::BFloat16>();
  const auto* w2p = w2.data_ptr<c10::BFloat16>();
  const int64_t s13e = w13.stride(0), s13r = w13.stride(1), s2e = w2.stride(0), s2r = w2.stride(1);

  // 1. h = clamped_swiglu(W13_e x): a task's 16 gate rows and their up rows against each group of the expert's tokens
  const std::vector<Task> up_tasks = expert_tasks(g.count, I);
  at::parallel_for(0, static_cast<int64_t>(up_tasks.size()), 1, [&](int64_t b, int64_t end) {
    alignas(64) float gate[kLanes][kLanes], up[kLanes][kLanes];
    amx_configure();
    for (; b < end; ++b) {
      const Task& task = up_tasks[b];
      const int64_t e = task.expert;
      const c10::BFloat16* rows = w13p + e * s13e + task.row0 * s13r;
      for (int64_t q = 0; q < ceil_div(g.count[e], kLanes); ++q) {
        const int64_t group = group0[e] + q;
        amx_rows_by_pairs(rows, rows + I * s13r, s13r * 2, xtp + group * Dp * kLanes, D, gate, up);
        // h of a row pair in vectors (lanes past the tokens: swiglu(0, 0) = 0), as pairs of columns
        for (int i = 0; i < task.rows; i += 2) {
          alignas(64) c10::BFloat16 h[2][kLanes];
          for (int half = 0; half < 2; ++half)
            store(h[half], clamped_swiglu(load(gate[i + half]), load(up[i + half]), limit));
          const __m512i lo = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(h[0])));
          const __m512i hi = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(h[1])));
          _mm512_storeu_si512(htp32 + (group * Ip + (task.row0 + i) / 2) * kLanes,
                              _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
      }
    }
    amx_release();
  });

  // 2. y = W2_e h: a task's 16 rows of W2 against each group of the expert's h
  const std::vector<Task> down_tasks = expert_tasks(g.count, D);
  at::parallel_for(0, static_cast<int64_t>(down_tasks.size()), 1, [&](int64_t b, int64_t end) {
    alignas(64) float c[kLanes][kLanes];
    amx_configure();
    for (; b < end; ++b) {
      const Task& task = down_tasks[b];
      const int64_t e = task.expert;
      for (int64_t q = 0; q < ceil_div(g.count[e], kLanes); ++q) {
        const int64_t n = std::min<int64_t>(kLanes, g.count[e] - q * kLanes);
        amx_rows_by_pairs(w2p + e * s2e + task.row0 * s2r, nullptr, s2r * 2,
                          htp32 + (group0[e] + q) * Ip * kLanes, I, c, nullptr);
        store_tile_columns(c, task.rows, n, yp + (g.start[e] + q * kLanes) * D + task.row0, D);
      }
    }
    amx_release();
  });
  return y;
}
#endif

}  // namespace

// x [T, D] (float32 / bf16 / fp16), w13 [E, 2I, D] (rows: I gate, then I up), w2 [E, D, I] (w13's dtype, any
// of the three), ids [T, k] int32 / int64 in [0, E), weights [T, k] -> out [T, D] float32.
at::Tensor moe_experts(const at::Tensor& x_, const at::Tensor& w13_, const at::Tensor& w2_, const at::Tensor& ids_,
                       const at::Tensor& weights_, double swiglu_limit) {
  TORCH_CHECK(w13_.scalar_type() == w2_.scalar_type(), "moe_experts: w13 and w2 dtypes differ");
  const Routing g = route_pairs("moe_experts", x_, w13_, w2_, ids_, weights_);
  const int64_t D = g.D, I = w13_.size(1) / 2, P = g.P;
  if (P == 0 || D == 0) return at::zeros({g.T, D}, x_.options().dtype(at::kFloat));
  at::Tensor w13 = rows_contiguous(w13_), w2 = rows_contiguous(w2_);
  const float limit = static_cast<float>(swiglu_limit);
#if GLM53_HAS_AMX
  // bfloat16 weights and tokens on a CPU with AMX tiles, kAmxExpertMinPairs or more pairs per used expert: on them
  // (experts_bf16_amx)
  if (x_.scalar_type() == at::kBFloat16 && w13.scalar_type() == at::kBFloat16 && D % 32 == 0 && I % 32 == 0 &&
      P >= kAmxExpertMinPairs * std::count_if(g.count.begin(), g.count.end(), [](int64_t c) { return c > 0; }) &&
      amx_tiles())
    return combine_pairs(g, experts_bf16_amx(g, w13, w2, I, limit));
#endif
  const std::vector<int64_t>&count = g.count, &start = g.start, &token_at = g.token_at;
  at::Tensor h = at::empty({P, I}, g.x.options()), y = at::empty({P, D}, g.x.options());
  const float* xp = g.x.data_ptr<float>();
  const int64_t x_chunk = token_chunk(D), h_chunk = token_chunk(I);
  float *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>();
  AcrossLanes lanes = tile_tokens(g, I);

  GLM53_DISPATCH_FLOAT_TYPES(w13.scalar_type(), "moe_experts weights", [&] {
    const scalar_t* w13p = w13.data_ptr<scalar_t>();
    const scalar_t* w2p = w2.data_ptr<scalar_t>();
    const int64_t s13e = w13.stride(0), s13r = w13.stride(1), s2e = w2.stride(0), s2r = w2.stride(1);

    // Rows prefetched ahead: step 1 of the gate and of the up rows it reads, step 2 of its row pairs.
    const int64_t ahead = rows_ahead(D * sizeof(scalar_t)), down_ahead = 2 * rows_ahead(2 * I * sizeof(scalar_t));

    // 1. h = clamped_swiglu(W13_e x) for each expert's tokens, a block of intermediate rows per task.
    const std::vector<Task> up_tasks = expert_tasks(count, I);
    at::parallel_for(0, static_cast<int64_t>(up_tasks.size()), 1, [&](int64_t b, int64_t end) {
      float acc[2][kTok];
      const float* xs[kTok];
      std::vector<float> tile, tile_acc;
      TaskSums<kAcrossLanesMinTokens - 1> sums;
      for (; b < end; ++b) {
        const Task& task = up_tasks[b];
        const scalar_t* we = w13p + task.expert * s13e;
        if (lanes.groups(task.expert) > 0) {
          tile.resize(kRowTile * kColumnChunk), tile_acc.resize(kTilePassGroups * kRowTile * kLanes);
          const auto row = [&](bool up, int64_t r) { return we + ((up ? I : 0) + r) * s13r; };  // gate / up row r
          swiglu_tile(
              task.row0, task.row0 + task.rows,
              [&](bool up, int64_t r) { return reinterpret_cast<const char*>(row(up, r)); }, sizeof(scalar_t),
              [&](bool up, int64_t r, int64_t k0, int64_t n, float* out) { to_float(row(up, r) + k0, out, n); },
              [](bool) -> const float* { return nullptr; }, lanes.x_of(task.expert, D), lanes.groups(task.expert), D,
              kColumnChunk, limit, h_lanes(lanes.h_of(task.expert, I), I, g.h_type), tile.data(), tile_acc.data());
          continue;
        }
        // fewer than kAcrossLanesMinTokens tokens (the others took the tile path)
        const int64_t first = start[task.expert], last = start[task.expert + 1];
        for (int64_t c0 = first; c0 < last; c0 += x_chunk) {
          const int64_t c1 = std::min(c0 + x_chunk, last);
          for (int64_t r = task.row0; r < task.row0 + task.rows; ++r) {
            const scalar_t* rows[2] = {we + r * s13r, we + (I + r) * s13r};
            const int64_t rn = std::min(r + ahead, I - 1);
            const scalar_t* next[2] = {we + rn * s13r, we + (I + rn) * s13r};
            for (int64_t j0 = c0; j0 < c1; j0 += kTok) {
              const int n = static_cast<int>(std::min<int64_t>(kTok, c1 - j0));
              for (int j = 0; j < n; ++j) xs[j] = xp + token_at[j0 + j] * D;
              dot_tokens<2>(rows, j0 == c0 ? next : nullptr, xs, n, D, acc);
              sums.put(r - task.row0, j0 - first, n, acc[0], acc[1]);
            }
          }
        }
        sums.swiglu(last - first, task.rows, limit, [&](int64_t j, F16 h) {
          store(hp + (first + j) * I + task.row0, as_h(g.h_type, h), static_cast<int>(task.rows));
        });
      }
    });

    // 2. y = W2_e h for each expert's pairs, a block of hidden rows per task (rows two at a time, an odd last one).
    const std::vector<Task> down_tasks = expert_tasks(count, D);
    at::parallel_for(0, static_cast<int64_t>(down_tasks.size()), 1, [&](int64_t b, int64_t end) {
      float acc[2][kTok];
      const float* hs[kTok];
      std::vector<float> tile, tile_acc;
      for (; b < end; ++b) {
        const Task& task = down_tasks[b];
        const scalar_t* we = w2p + task.expert * s2e;
        if (lanes.groups(task.expert) > 0) {
          tile.resize(kRowTile * kColumnChunk), tile_acc.resize(kTilePassGroups * kRowTile * kLanes);
          const int64_t c0 = start[task.expert];
          down_tile(
              task.row0, task.row0 + task.rows,
              [&](int64_t r) { return reinterpret_cast<const char*>(we + r * s2r); }, sizeof(scalar_t),
              [&](int64_t r, int64_t k0, int64_t n, float* out) { to_float(we + r * s2r + k0, out, n); }, nullptr,
              lanes.h_of(task.expert, I), start[task.expert + 1] - c0, I, D, kColumnChunk, yp + c0 * D, tile.data(),
              tile_acc.data());
          continue;
        }
        for (int64_t c0 = start[task.expert]; c0 < start[task.expert + 1]; c0 += h_chunk) {
          const int64_t c1 = std::min(c0 + h_chunk, start[task.expert + 1]);
          for (int64_t r = task.row0; r < task.row0 + task.rows; r += 2) {
            const int nr = static_cast<int>(std::min<int64_t>(2, task.row0 + task.rows - r));
            const scalar_t* rows[2] = {we + r * s2r, we + (r + nr - 1) * s2r};
            const int64_t rn = std::min(r + down_ahead, D - 2);
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
  return combine_pairs(g, y);
}

// The same with block-FP8 weights kept as E4M3 bytes: w13 [E, 2I, D] and w2 [E, D, I] float8_e4m3fn, their
// float32 block scales w13_scale [E, 2 * ceil(I / bn), ceil(D / bk)] (gate blocks, then up blocks: the two halves
// are separate checkpoint tensors, each with its own ragged last block) and w2_scale [E, ceil(D / bn),
// ceil(I / bk)]. Per expert, the direct path for at most kE4m3DirectMaxTokens tokens (kPairsDirectMaxTokens on
// bfloat16 pairs), else the tile path (gemv.h).
at::Tensor moe_experts_fp8(const at::Tensor& x_, const at::Tensor& w13_, const at::Tensor& w13_scale_,
                           const at::Tensor& w2_, const at::Tensor& w2_scale_, const at::Tensor& ids_,
                           const at::Tensor& weights_, double swiglu_limit, int64_t block_n, int64_t block_k) {
  const char* what = "moe_experts_fp8";
  TORCH_CHECK(w13_.scalar_type() == at::kFloat8_e4m3fn && w2_.scalar_type() == at::kFloat8_e4m3fn, what,
              ": w13 and w2 must be float8_e4m3fn");
  check_fp8_blocks(what, block_n, block_k);
  const Routing g = route_pairs(what, x_, w13_, w2_, ids_, weights_);
  const int64_t D = g.D, E = g.E, I = w13_.size(1) / 2, P = g.P;
  const int64_t nbI = ceil_div(I, block_n), kbD = ceil_div(D, block_k), nbD = ceil_div(D, block_n),
                kbI = ceil_div(I, block_k);
  TORCH_CHECK(w13_scale_.scalar_type() == at::kFloat && w2_scale_.scalar_type() == at::kFloat, what,
              ": scales must be float32");
  TORCH_CHECK(w13_scale_.dim() == 3 && w13_scale_.size(0) == E && w13_scale_.size(1) == 2 * nbI &&
                  w13_scale_.size(2) == kbD,
              what, ": w13_scale must be [", E, ", ", 2 * nbI, ", ", kbD, "], got ", w13_scale_.sizes());
  TORCH_CHECK(w2_scale_.dim() == 3 && w2_scale_.size(0) == E && w2_scale_.size(1) == nbD && w2_scale_.size(2) == kbI,
              what, ": w2_scale must be [", E, ", ", nbD, ", ", kbI, "], got ", w2_scale_.sizes());
  if (P == 0 || D == 0) return at::zeros({g.T, D}, x_.options().dtype(at::kFloat));
  const at::Tensor w13 = rows_contiguous(w13_), w2 = rows_contiguous(w2_);
  const at::Tensor w13_scale = w13_scale_.contiguous(), w2_scale = w2_scale_.contiguous();
  const float limit = static_cast<float>(swiglu_limit);
  const std::vector<int64_t>&count = g.count, &start = g.start, &token_at = g.token_at;
  at::Tensor h = at::empty({P, I}, g.x.options()), y = at::empty({P, D}, g.x.options());
  const float* xp = g.x.data_ptr<float>();
  float *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>();
  const E4m3* w13p = reinterpret_cast<const E4m3*>(w13.data_ptr());
  const E4m3* w2p = reinterpret_cast<const E4m3*>(w2.data_ptr());
  const float *s13p = w13_scale.data_ptr<float>(), *s2p = w2_scale.data_ptr<float>();
  const int64_t s13e = w13.stride(0), s13r = w13.stride(1), s2e = w2.stride(0), s2r = w2.stride(1);

  // bfloat16 tokens on a CPU with bfloat16 dot products: both steps multiply bfloat16 pairs (gemv.h). The direct
  // path reads its token rows in unpack order: step 1 the rows of x that a direct-path expert takes (xo, row
  // xo_row[t] for token t), step 2 h's, which is bfloat16 for bfloat16 tokens (as_h): step 1 writes it for the
  // direct path in unpack order too (hb) and for the tile path as pairs across the lanes. 16 released-size experts,
  // 2 threads, caches flushed: pairs in step 1 (Zen 4) 1.3-1.4x faster at 4-8 tokens each, 1.2-1.3x at 16-32; in
  // step 2 as well (Zen 5) another 1.3x at 4 tokens each (15.8 -> 12.0 ms, the floor ~10.3), 1.55x at 8, 1.3x at
  // 16-32.
  const bool pairs = bf16_pairs(x_.scalar_type(), D);
  const bool down_pairs = pairs && bf16_pairs(x_.scalar_type(), I);
  // Experts up to direct_max tokens take the direct path in both steps (with bfloat16 pairs in both, further than
  // the float32 forms go: gemv.h's kPairsDirectMaxTokens), the others from kAcrossLanesMinTokens the tile path.
  const bool amx = down_pairs && amx_tiles();
  const int64_t direct_max = down_pairs ? pairs_direct_max(amx, D) : kE4m3DirectMaxTokens;
  const UnpackOrder x_order(D, block_k), h_order(I, block_k);
  std::vector<int64_t> xo_row(pairs ? g.T : 0, -1), xo_token;
  if (pairs)
    for (int64_t e = 0; e < E; ++e)
      if (count[e] > 0 && count[e] <= direct_max)
        for (int64_t c = start[e]; c < start[e + 1]; ++c)
          if (xo_row[token_at[c]] < 0)
            xo_row[token_at[c]] = static_cast<int64_t>(xo_token.size()), xo_token.push_back(token_at[c]);
  const int64_t xo_rows = static_cast<int64_t>(xo_token.size());
  const auto bf16 = x_.options().dtype(at::kBFloat16);
  const at::Tensor xo = x_order.padded() ? at::zeros({xo_rows, x_order.len}, bf16)  // as hb below
                                         : at::empty({xo_rows, x_order.len}, bf16);
  c10::BFloat16* xop = xo.data_ptr<c10::BFloat16>();
  at::parallel_for(0, xo_rows, 16, [&](int64_t i, int64_t end) {
    for (; i < end; ++i) x_order.put(xp + xo_token[i] * D, xop + i * x_order.len);
  });
  at::Tensor hb = !down_pairs          ? at::Tensor()
                  : h_order.padded() ? at::zeros({P, h_order.len}, bf16)  // the padding's zeros are read
                                     : at::empty({P, h_order.len}, bf16);
  c10::BFloat16* hbp = down_pairs ? hb.data_ptr<c10::BFloat16>() : nullptr;
  const std::vector<int64_t> h_at = down_pairs ? h_order.positions() : std::vector<int64_t>();
  // h of pair slot ``slot``, rows [r0, r0 + rows) (a task's), rounded as as_h says, into h and (bfloat16 pairs in
  // step 2) hb
  const auto put_h = [&](int64_t slot, int64_t r0, int64_t rows, F16 v) {
    v = as_h(g.h_type, v);
    store(hp + slot * I + r0, v, static_cast<int>(rows));
    if (hbp == nullptr) return;
    alignas(64) c10::BFloat16 b[kLanes];
    store(b, v);
    for (int64_t i = 0; i < rows; ++i) hbp[slot * h_order.len + h_at[r0 + i]] = b[i];
  };
  AcrossLanes lanes = tile_tokens(g, I, amx ? direct_max + 1 : std::max(kAcrossLanesMinTokens, direct_max + 1),
                                  pairs ? &x_order : nullptr,
                                  down_pairs ? &h_order : nullptr);
  const int64_t chunk = ceil_div(kColumnChunk, block_k) * block_k;  // tile columns: whole scale blocks
  // Rows the direct paths prefetch ahead in each stream of rows (TaskRows): kAheadBytes on (rows_ahead).
  const int64_t ahead = rows_ahead(D), down_ahead = rows_ahead(I);

  // 1. h = clamped_swiglu(W13_e x): a task's rows lie in one gate row block and the same up row block.
  const std::vector<Task> up_tasks = expert_tasks(count, I);
  at::parallel_for(0, static_cast<int64_t>(up_tasks.size()), 1, [&](int64_t b, int64_t end) {
    // direct: the tokens times the gate block's and the up block's scales; few: one gate row and one up row (each
    // part written before it is read: not zeroed, 896 KiB a thread and call at the release's size on avx2)
    const int64_t Dq = direct_len(D);  // a scaled token row's length (scale_by_blocks)
    const std::unique_ptr<float[]> buf(new float[2 * kE4m3DirectMaxTokens * Dq]);
    std::vector<float> tile(pairs ? 0 : kRowTile * chunk), acc(2 * kTilePassGroups * kRowTile * kLanes);
    const TileBuffer<c10::BFloat16> tile16(
        pairs ? kTileBlocks<c10::BFloat16> * kRowTile * tile_stride<c10::BFloat16>(block_k) : 0);
    float sums[2][1];  // the one-token float32 path's (dot_row_tokens)
    TaskSums<std::max({kPairsDirectMaxTokens, kE4m3DirectMaxTokens, kAcrossLanesMinTokens - 1})> task_sums;
    float(*const to_task_sums[2])[kLanes] = {task_sums.gate, task_sums.up};
    int64_t scaled_for = -1;  // the (expert, row block) whose scaled tokens buf holds
#if GLM53_AVX2
    const bool quads = quads_fit(block_k);  // one token: gemv.h's task_quads, the token in quad order (xq)
    const std::unique_ptr<float[]> xq(new float[quads ? quad_len(D) : 0]);
    int64_t quad_for = -1;  // the token xq holds
#endif
    for (; b < end; ++b) {
      const Task& task = up_tasks[b];
      const int64_t e = task.expert, c0 = start[e], c1 = start[e + 1], last = task.row0 + task.rows;
      const E4m3* we = w13p + e * s13e;
      const float* gate_scale = s13p + (e * 2 * nbI + task.row0 / block_n) * kbD;
      const float* up_scale = gate_scale + nbI * kbD;
      const auto row = [&](bool up, int64_t r) { return we + ((up ? I : 0) + r) * s13r; };
      const auto bytes = [&](bool up, int64_t r) { return reinterpret_cast<const char*>(row(up, r)); };
      // The task's gate rows and up rows, for the direct paths that take a task a call (their sums into task_sums)
      const TaskRows gate_up{{row(false, task.row0), row(true, task.row0)}, {gate_scale, up_scale}, 2, s13r,
                             task.rows, ahead, I - task.row0};
      // h of the expert's n tokens from the task's sums (task_sums)
      const auto put_task_h = [&](int64_t n) {
        task_sums.swiglu(n, task.rows, limit, [&](int64_t j, F16 h) { put_h(c0 + j, task.row0, task.rows, h); });
      };
#if GLM53_AVX512
      if (pairs && c1 - c0 <= direct_max) {
        const int n = static_cast<int>(c1 - c0);
        const c10::BFloat16* xs[kPairsDirectMaxTokens];
        for (int j = 0; j < n; ++j) xs[j] = xop + xo_row[token_at[c0 + j]] * x_order.len;
        dot_task_pairs(gate_up, xs, n, D, block_k, to_task_sums);
        put_task_h(n);
        continue;
      }
      if (pairs && lanes.groups(e) > 0) {  // the experts tile_tokens laid out
        const auto tile_rows = [&](const auto& put) {
          swiglu_tile(
              task.row0, last, bytes, 1,
              [&](bool up, int64_t r, int64_t k0, int64_t n, c10::BFloat16* out) {
                e4m3_unpacked(row(up, r) + k0, n, out);
              },
              [&](bool up) { return up ? up_scale : gate_scale; }, lanes.pairs_of(e, x_order.len), lanes.groups(e), D,
              block_k, limit, put, tile16.data(), acc.data());
        };
        if (down_pairs) tile_rows(h_pairs(lanes.h_pairs_of(e, h_order.len), h_order.len, h_at.data()));
        else tile_rows(h_lanes(lanes.h_of(e, I), I, g.h_type));
        continue;
      }
#endif
#if GLM53_AVX2
      if (c1 - c0 == 1 && quads) {  // the gate and up rows share the token, each row block's scales on its sums
        if (quad_for != token_at[c0]) quad_order(xp + token_at[c0] * D, D, xq.get()), quad_for = token_at[c0];
        task_quads(gate_up, xq.get(), D, block_k, to_task_sums);
        put_task_h(1);
        continue;
      }
#endif
      if (c1 - c0 <= kE4m3DirectMaxTokens) {
        const int n = static_cast<int>(c1 - c0);
        float* xg = buf.get();
        float* xu = xg + kE4m3DirectMaxTokens * Dq;
        if (scaled_for != e * nbI + task.row0 / block_n) {
          for (int j = 0; j < n; ++j) {
            scale_by_blocks(xp + token_at[c0 + j] * D, gate_scale, D, block_k, xg + j * Dq);
            scale_by_blocks(xp + token_at[c0 + j] * D, up_scale, D, block_k, xu + j * Dq);
          }
          scaled_for = e * nbI + task.row0 / block_n;
        }
        if (n == 1) {  // a gate row and its up row at a time, each against its own scaled token (see below)
          for (int64_t r = task.row0; r < last; ++r) {
            const int64_t rn = std::min(r + ahead, I - 1);
            const E4m3* rows[2] = {row(false, r), row(true, r)};
            const E4m3* next[2] = {row(false, rn), row(true, rn)};
            dot_row_tokens(rows, next, xg, xu - xg, D, sums);
            task_sums.put(r - task.row0, 0, 1, sums[0], sums[1]);
          }
          put_task_h(1);
          continue;
        }
        // More tokens: a gate row pair, then its up rows, each token load serving two rows (with a token of its own
        // per row, avx2 spilled at 2 tokens: 0.86x).
        const float* xgs[kE4m3DirectMaxTokens];
        const float* xus[kE4m3DirectMaxTokens];
        for (int j = 0; j < n; ++j) xgs[j] = xg + j * Dq, xus[j] = xu + j * Dq;
        const float* const* xs[2] = {xgs, xus};
        dot_task_rows(gate_up, xs, n, D, to_task_sums);
        put_task_h(n);
        continue;
      }
      if (c1 - c0 < kAcrossLanesMinTokens) {
        scaled_for = -1;  // buf now holds dequantized rows
        float* rows_f[2] = {buf.get(), buf.get() + D};
        const float* rows[2] = {rows_f[0], rows_f[1]};
        const float* xs[kTok];
        for (int64_t r = task.row0; r < last; ++r) {
          dequantize_row(we + r * s13r, gate_scale, D, block_k, rows_f[0]);
          dequantize_row(we + (I + r) * s13r, up_scale, D, block_k, rows_f[1]);
          for (int64_t j0 = c0; j0 < c1; j0 += kTok) {
            const int n = static_cast<int>(std::min<int64_t>(kTok, c1 - j0));
            for (int j = 0; j < n; ++j) xs[j] = xp + token_at[j0 + j] * D;
            float part[2][kTok];
            dot_tokens<2>(rows, nullptr, xs, n, D, part);
            task_sums.put(r - task.row0, j0 - c0, n, part[0], part[1]);
          }
        }
        put_task_h(c1 - c0);
        continue;
      }
      swiglu_tile(
          task.row0, last, bytes, 1,
          [&](bool up, int64_t r, int64_t k0, int64_t n, float* out) {
            dequantize_row(row(up, r) + k0, (up ? up_scale : gate_scale) + k0 / block_k, n, block_k, out);
          },
          [](bool) -> const float* { return nullptr; }, lanes.x_of(e, D), lanes.groups(e), D, chunk, limit,
          h_lanes(lanes.h_of(e, I), I, g.h_type), tile.data(), acc.data());
    }
  });

  // 2. y = W2_e h: a task's rows lie in one row block of W2.
  const std::vector<Task> down_tasks = expert_tasks(count, D);
  at::parallel_for(0, static_cast<int64_t>(down_tasks.size()), 1, [&](int64_t b, int64_t end) {
    // direct: scaled h rows; few: two W2 rows (not zeroed, as in step 1)
    const int64_t Iq = direct_len(I);  // a scaled h row's length (scale_by_blocks)
    const std::unique_ptr<float[]> buf(new float[std::max(kE4m3DirectMaxTokens * Iq, 2 * I)]);
    std::vector<float> tile(down_pairs ? 0 : kRowTile * chunk), acc(kTilePassGroups * kRowTile * kLanes);
    const TileBuffer<c10::BFloat16> tile16(
        down_pairs ? kTileBlocks<c10::BFloat16> * kRowTile * tile_stride<c10::BFloat16>(block_k) : 0);
    const float* hs[kE4m3DirectMaxTokens];
    // the direct paths' sums, a vector of the task's rows per token
    alignas(64) float y_sums[std::max(kPairsDirectMaxTokens, kE4m3DirectMaxTokens)][kLanes];
    float(*const to_y_sums[2])[kLanes] = {y_sums, nullptr};
    int64_t scaled_for = -1;
#if GLM53_AVX2
    const bool quads = quads_fit(block_k);  // one token: task_quads, as in step 1
    const std::unique_ptr<float[]> hq(new float[quads ? quad_len(I) : 0]);
    int64_t quad_for = -1;  // the (token, choice) pair whose h row hq holds
#endif
    for (; b < end; ++b) {
      const Task& task = down_tasks[b];
      const int64_t e = task.expert, c0 = start[e], c1 = start[e + 1], last = task.row0 + task.rows;
      const E4m3* we = w2p + e * s2e;
      const float* scale = s2p + (e * nbD + task.row0 / block_n) * kbI;
      const auto bytes = [&](int64_t r) { return reinterpret_cast<const char*>(we + r * s2r); };
      // The task's rows, for the direct paths that take a task a call; put_y: their sums (y_sums) into y
      const TaskRows down{{we + task.row0 * s2r, nullptr}, {scale, nullptr}, 1, s2r, task.rows, down_ahead,
                          D - task.row0};
      const auto put_y = [&](int64_t n) {
        for (int64_t j = 0; j < n; ++j)
          store(yp + (c0 + j) * D + task.row0, load(y_sums[j]), static_cast<int>(task.rows));
      };
#if GLM53_AVX512
      if (down_pairs && c1 - c0 <= direct_max) {
        const int n = static_cast<int>(c1 - c0);
        const c10::BFloat16* hs16[kPairsDirectMaxTokens];
        for (int j = 0; j < n; ++j) hs16[j] = hbp + (c0 + j) * h_order.len;
        dot_task_pairs(down, hs16, n, I, block_k, to_y_sums);
        put_y(n);
        continue;
      }
      if (down_pairs && lanes.groups(e) > 0) {  // the experts tile_tokens laid out: past direct_max tokens
        down_tile(
            task.row0, last, bytes, 1,
            [&](int64_t r, int64_t k0, int64_t n, c10::BFloat16* out) { e4m3_unpacked(we + r * s2r + k0, n, out); },
            scale, lanes.h_pairs_of(e, h_order.len), c1 - c0, I, D, block_k, yp + c0 * D, tile16.data(), acc.data());
        continue;
      }
#endif
#if GLM53_AVX2
      if (c1 - c0 == 1 && quads) {
        if (quad_for != c0) quad_order(hp + c0 * I, I, hq.get()), quad_for = c0;
        task_quads(down, hq.get(), I, block_k, to_y_sums);
        put_y(1);
        continue;
      }
#endif
      if (c1 - c0 <= kE4m3DirectMaxTokens) {
        const int n = static_cast<int>(c1 - c0);
        if (scaled_for != e * nbD + task.row0 / block_n) {
          for (int j = 0; j < n; ++j) scale_by_blocks(hp + (c0 + j) * I, scale, I, block_k, buf.get() + j * Iq);
          scaled_for = e * nbD + task.row0 / block_n;
        }
        for (int j = 0; j < n; ++j) hs[j] = buf.get() + j * Iq;
        const float* const* xs[2] = {hs, nullptr};
        dot_task_rows(down, xs, n, I, to_y_sums);
        put_y(n);
        continue;
      }
      if (c1 - c0 < kAcrossLanesMinTokens) {
        scaled_for = -1;
        float* rows_f[2] = {buf.get(), buf.get() + I};
        const float* rows[2] = {rows_f[0], rows_f[1]};
        for (int64_t r = task.row0; r < last; r += 2) {
          const int nr = static_cast<int>(std::min<int64_t>(2, last - r));
          for (int i = 0; i < nr; ++i) dequantize_row(we + (r + i) * s2r, scale, I, block_k, rows_f[i]);
          for (int64_t j0 = c0; j0 < c1; j0 += kTok) {
            const int n = static_cast<int>(std::min<int64_t>(kTok, c1 - j0));
            for (int j = 0; j < n; ++j) hs[j] = hp + (j0 + j) * I;
            float part[2][kTok];
            if (nr == 2) dot_tokens<2>(rows, nullptr, hs, n, I, part);
            else dot_tokens<1>(rows, nullptr, hs, n, I, part);
            for (int j = 0; j < n; ++j)
              for (int i = 0; i < nr; ++i) yp[(j0 + j) * D + r + i] = part[i][j];
          }
        }
        continue;
      }
      down_tile(
          task.row0, last, bytes, 1,
          [&](int64_t r, int64_t k0, int64_t n, float* out) {
            dequantize_row(we + r * s2r + k0, scale + k0 / block_k, n, block_k, out);
          },
          nullptr, lanes.h_of(e, I), c1 - c0, I, D, chunk, yp + c0 * D, tile.data(), acc.data());
    }
  });
  return combine_pairs(g, y);
}

}  // namespace glm53
