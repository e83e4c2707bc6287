// Absorbed sparse MLA on CPU: attention of latent-space queries over the selected rows of the paged latent
// cache (the contract of vllm_glm53/backends/cpu/sparse_mla.py, batched over requests).
//
// Each query reads only its selected rows, straight from the cache pages through the block table, so a decode
// step costs O(index width), not O(context). Rows are taken in blocks of 16: the heads of the task score the
// block, then fold it into their accumulators with an online softmax (running max and sum, rescaled once per
// block), so every selected row is fetched from memory once per task. Few heads go kHeads at a time (4 with AVX-512,
// 2 with AVX2) so each load of a row feeds that many heads' FMAs; from 16 heads the scores put the heads on the lanes
// instead, each latent value of a row broadcast against vectors of heads (score_lanes). The selected rows sit at random
// places in the cache, one 2 KiB row here and there, so the hardware prefetchers cannot run ahead of them: while a
// group of rows is scored, rows further on are requested one cache line per lane group (about 2x faster than without,
// on the development machine; requesting a whole block at once overflowed the line-fill buffers and gained nothing).
// With bfloat16 queries and cache and 16 or more heads, a CPU with AMX runs the attention as tile products instead
// (attend_tiles below), and one with AVX512_BF16 but no AMX as the same products on bfloat16 dot products
// (attend_pairs).

#include <torch/library.h>

#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "amx.h"
#include "common.h"
#include "gemv.h"  // token_pairs_into

namespace glm53 {
namespace {

// The float32 path's tiles sized to the register file (vec.h). Few heads (below kTileMinHeads): scoring keeps kHeads x
// kRowGroup partial sums and kHeads query vectors, the update kHeads x kUnroll accumulators; 4 / 4 / 4 with AVX-512's
// 32 registers, 2 / 2 / 2 below.
constexpr int kBlock = kLanes;  // rows per online-softmax step
constexpr int kTile = kVectorRegs >= 32 ? 4 : 2;
constexpr int kHeads = kTile;     // heads that share each load of a row
constexpr int kRowGroup = kTile;  // rows scored together
constexpr int kUnroll = kTile;    // lane groups of the accumulators updated together
// From kTileMinHeads heads the scores put the heads on the lanes (score_lanes): kLaneRows rows x kLaneVecs vectors
// of 16 heads in registers, each latent value of a row broadcast (8 x 2 with AVX-512, 6 x 1 with AVX2: 12 of its 16
// registers), and the update keeps kLaneHeads heads x kLaneUnroll lane groups.
constexpr int kLaneRows = kVectorRegs >= 32 ? 8 : kVectorRegs >= 8 ? 6 : 2;
constexpr int kLaneVecs = kVectorRegs >= 32 ? 2 : 1;
constexpr int kLaneHeads = kVectorRegs >= 32 ? 4 : kVectorRegs >= 8 ? 6 : 2;
constexpr int kLaneUnroll = kVectorRegs >= 32 ? 4 : 1;
constexpr int64_t kTileMinHeads = 16;  // fewer heads score as below, and stay off the tiles (benchmarks/README.md)

// acc [HG, L] = corr[h] acc[h] + sum_{j < nb} p(h, j) row_j, p(h, j) = p[h * ph + j * pj], on the CU lane groups
// from c0 (Whole: all of them below L): they stay in registers over the block for the HG heads, each lane group of a
// row loaded once for all of them.
template <int HG, int CU, bool Whole>
[[gnu::always_inline]] inline void update_columns(const float* p, int64_t ph, int64_t pj, const float* corr,
                                                  const float* const* blk, int nb, int64_t L, int64_t c0, float* acc) {
  int m[CU];
  F16 a[HG][CU];
  for (int u = 0; u < CU; ++u) {
    m[u] = Whole ? kLanes : static_cast<int>(std::clamp<int64_t>(L - c0 - u * kLanes, 0, kLanes));
    for (int h = 0; h < HG; ++h) a[h][u] = load(acc + h * L + c0 + u * kLanes, m[u]) * set1(corr[h]);
  }
  for (int j = 0; j < nb; ++j) {
    F16 r[CU];
    for (int u = 0; u < CU; ++u) r[u] = load(blk[j] + c0 + u * kLanes, m[u]);
    for (int h = 0; h < HG; ++h) {
      const F16 w = set1(p[h * ph + j * pj]);
      for (int u = 0; u < CU; ++u) a[h][u] = fma(w, r[u], a[h][u]);
    }
  }
  for (int u = 0; u < CU; ++u)
    for (int h = 0; h < HG; ++h) store(acc + h * L + c0 + u * kLanes, a[h][u], m[u]);
}

// update_columns over the whole latent: the masks of a partial last step out of the loop (inside it, a test and
// branch beside every load of a row).
template <int HG, int CU>
void update_block(const float* p, int64_t ph, int64_t pj, const float* corr, const float* const* blk, int nb,
                  int64_t L, float* acc) {
  int64_t c0 = 0;
  for (; c0 + CU * kLanes <= L; c0 += CU * kLanes) update_columns<HG, CU, true>(p, ph, pj, corr, blk, nb, L, c0, acc);
  if (c0 < L) update_columns<HG, CU, false>(p, ph, pj, corr, blk, nb, L, c0, acc);
}

// One online-softmax step of HG heads over a block of nb <= kBlock rows (float32, L values each), for few heads.
// q [HG, L]; acc [HG, L], run_max / run_sum [HG] are the heads' running state.
template <int HG>
void attend_block(const float* q, int64_t L, const float* const* blk, int nb, const void* const* next, int n_next,
                  float scale, float* acc, float* run_max, float* run_sum) {
  // Logits: each lane group of a row is loaded once and used by all HG heads.
  float logit[HG][kBlock];
  for (int j0 = 0; j0 < nb; j0 += kRowGroup) {
    const int nj = std::min(kRowGroup, nb - j0);
    // The rows of the following group (this block's, else the next block's first) are prefetched one cache
    // line per lane group while this group is scored: the selected rows sit at random places, so without it
    // only the few rows being read have misses in flight.
    const void* ahead[kRowGroup];
    int n_ahead = 0;
    for (int j = j0 + kRowGroup; j < j0 + 2 * kRowGroup; ++j) {
      if (j < nb) ahead[n_ahead++] = blk[j];
      else if (j - nb < n_next) ahead[n_ahead++] = next[j - nb];
    }
    // A whole group of rows every time (a short last group repeats its last row, whose extra sums are dropped), and
    // the masked tail out of the loop: so the sums stay in registers. With a loop to nj and the mask inside, the
    // compiler kept them in memory too, a store beside every FMA (1.3x slower at 64 heads).
    const float* group[kRowGroup];
    for (int j = 0; j < kRowGroup; ++j) group[j] = blk[j0 + std::min(j, nj - 1)];
    F16 part[HG][kRowGroup];
    for (int h = 0; h < HG; ++h)
      for (int j = 0; j < kRowGroup; ++j) part[h][j] = zero();
    const auto columns = [&](int64_t c, int m) {
      for (int r = 0; r < n_ahead; ++r) __builtin_prefetch(static_cast<const char*>(ahead[r]) + c * sizeof(float));
      F16 qv[HG];
      for (int h = 0; h < HG; ++h) qv[h] = load(q + h * L + c, m);
      for (int j = 0; j < kRowGroup; ++j) {
        const F16 r = load(group[j] + c, m);
        for (int h = 0; h < HG; ++h) part[h][j] = fma(qv[h], r, part[h][j]);
      }
    };
    int64_t c = 0;
    for (; c + kLanes <= L; c += kLanes) columns(c, kLanes);  // whole lane groups: no mask in the loop
    if (c < L) columns(c, static_cast<int>(L - c));
    for (int h = 0; h < HG; ++h)
      for (int j = 0; j < nj; ++j) logit[h][j0 + j] = scale * reduce_add(part[h][j]);
  }
  // Softmax bookkeeping per head.
  float p[HG][kBlock], corr[HG];
  for (int h = 0; h < HG; ++h) {
    float m_new = run_max[h];
    for (int j = 0; j < nb; ++j) m_new = std::max(m_new, logit[h][j]);
    corr[h] = std::exp(run_max[h] - m_new);  // 0 on the first block (max was -inf)
    store(p[h], exp(load(logit[h], nb) - set1(m_new)), nb);
    run_sum[h] = run_sum[h] * corr[h] + reduce_add(load(p[h], nb));
    run_max[h] = m_new;
  }
  update_block<HG, kUnroll>(&p[0][0], kBlock, 1, corr, blk, nb, L, acc);
}

// attend_block for the last ``hg`` <= HG heads of a query (its instantiation picked by hg).
template <int HG = kHeads>
void attend_heads(int64_t hg, const float* q, int64_t L, const float* const* blk, int nb, const void* const* next,
                  int n_next, float scale, float* acc, float* run_max, float* run_sum) {
  if constexpr (HG > 1)
    if (hg < HG) return attend_heads<HG - 1>(hg, q, L, blk, nb, next, n_next, scale, acc, run_max, run_sum);
  attend_block<HG>(q, L, blk, nb, next, n_next, scale, acc, run_max, run_sum);
}

// s[r * ld + v * 16 + i] (r < n) = row r of ``group`` . head 16 v + i's query, for V vectors of 16 heads whose queries
// are qt [V, L, 16] (the heads on the lanes). Each latent value of a row is broadcast against V vectors of heads, so a
// column costs V vector loads and R broadcasts for R x V FMAs (the form with the latent on the lanes loads a row
// vector per head pair and sums each head's lanes after). A short group repeats its last row (its sums dropped).
template <int R, int V>
void score_lanes(const float* qt, int64_t L, const float* const* group, int n, const void* const* ahead, int n_ahead,
                 int64_t lines, float* s, int64_t ld) {
  F16 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = zero();
  const auto column = [&](int64_t c) {
    F16 qv[V];
    for (int v = 0; v < V; ++v) qv[v] = load(qt + (v * L + c) * kLanes);
    for (int r = 0; r < R; ++r) {
      const F16 x = set1(group[r][c]);
      for (int v = 0; v < V; ++v) acc[r][v] = fma(x, qv[v], acc[r][v]);
    }
  };
  // Whole lane groups, then the rest: with the group's length a variable, the compiler kept the sums in memory too.
  int64_t c0 = 0;
  for (; c0 + kLanes <= L; c0 += kLanes) {
    if (c0 / kLanes < lines)
      for (int a = 0; a < n_ahead; ++a) __builtin_prefetch(static_cast<const char*>(ahead[a]) + c0 / kLanes * 64);
    for (int i = 0; i < kLanes; ++i) column(c0 + i);
  }
  for (; c0 < L; ++c0) column(c0);
  for (int r = 0; r < n; ++r)
    for (int v = 0; v < V; ++v) store(s + r * ld + v * kLanes, acc[r][v]);
}

// score_lanes for the last ``nv`` <= V vectors of heads (its instantiation picked by nv).
template <int V = kLaneVecs>
void score_vectors(int64_t nv, const float* qt, int64_t L, const float* const* group, int n, const void* const* ahead,
                   int n_ahead, int64_t lines, float* s, int64_t ld) {
  if constexpr (V > 1)
    if (nv < V) return score_vectors<V - 1>(nv, qt, L, group, n, ahead, n_ahead, lines, s, ld);
  score_lanes<kLaneRows, V>(qt, L, group, n, ahead, n_ahead, lines, s, ld);
}

// update_block for the last ``hg`` <= HG heads, their weights p(h, j) = p[h + j * pj].
template <int HG = kLaneHeads>
void update_heads(int64_t hg, const float* p, int64_t pj, const float* corr, const float* const* blk, int nb,
                  int64_t L, float* acc) {
  if constexpr (HG > 1)
    if (hg < HG) return update_heads<HG - 1>(hg, p, pj, corr, blk, nb, L, acc);
  update_block<HG, kLaneUnroll>(p, 1, pj, corr, blk, nb, L, acc);
}

// One task's buffers on the float32 path, for up to ``heads`` heads (padded to vectors of 16 on the lanes) of latent L.
struct FloatScratch {
  int64_t Hp;
  std::vector<float> row_buf;    // [kBlock, L] the block's rows widened (caches other than float32)
  std::vector<float> q, qt;      // [heads, L] the queries; [Hp / 16, L, 16] with the heads on the lanes
  std::vector<float> acc, out;   // [heads, L] running sums; the result
  std::vector<float> s;          // [kBlock, Hp] a block's scores, then weights (heads on the lanes)
  std::vector<float> run_max, run_sum, corr;  // [Hp]
  FloatScratch(int64_t heads, int64_t L)
      : Hp((heads + kLanes - 1) / kLanes * kLanes), row_buf(kBlock * L), q(heads * L), qt(Hp * L), acc(heads * L),
        out(heads * L), s(kBlock * Hp), run_max(Hp), run_sum(Hp), corr(Hp) {}
};

// The online softmax of n rows' scores on one vector of 16 heads (row j's unscaled scores at s + j * ld): each
// scaled, then replaced by its weight exp(score - maximum); the heads' running maximum and sum updated. Returns the
// factor the heads' running sums take, exp(old maximum - new) (0 on the first block, whose maximum was -inf).
inline F16 softmax_rows(float* s, int64_t ld, int64_t n, float scale, float* run_max, float* run_sum) {
  const F16 sc = set1(scale), m_old = load(run_max);
  F16 m = m_old, sum = zero();
  for (int64_t j = 0; j < n; ++j) {
    const F16 x = load(s + j * ld) * sc;
    store(s + j * ld, x);
    m = vmax(m, x);
  }
  for (int64_t j = 0; j < n; ++j) {
    const F16 e = exp(load(s + j * ld) - m);
    store(s + j * ld, e);
    sum = sum + e;
  }
  const F16 corr = exp(m_old - m);
  store(run_sum, load(run_sum) * corr + sum);
  store(run_max, m);
  return corr;
}

// One block of nb rows for nh heads with the scores on the lanes (w.qt's nv vectors of heads), the next block's rows
// (n_next of them, ``lines`` cache lines each) requested while it is scored.
void lanes_block(int64_t nh, int64_t nv, int64_t L, const float* const* blk, int nb, const void* const* next,
                 int n_next, int64_t lines, float scale, FloatScratch& w) {
  const int64_t Hp = nv * kLanes;
  float* s = w.s.data();
  for (int j0 = 0; j0 < nb; j0 += kLaneRows) {
    const int n = std::min(kLaneRows, nb - j0);
    const float* group[kLaneRows];
    for (int g = 0; g < kLaneRows; ++g) group[g] = blk[j0 + std::min(g, n - 1)];
    const int n_ahead = std::clamp(n_next - j0, 0, kLaneRows);
    for (int64_t v = 0; v < nv; v += kLaneVecs)  // the group's rows stay in L1 over the vectors of heads
      score_vectors(nv - v, &w.qt[v * L * kLanes], L, group, n, next + j0, v == 0 ? n_ahead : 0, lines,
                    s + j0 * Hp + v * kLanes, Hp);
  }
  for (int64_t v = 0; v < nv; ++v)
    store(&w.corr[v * kLanes],
          softmax_rows(s + v * kLanes, Hp, nb, scale, &w.run_max[v * kLanes], &w.run_sum[v * kLanes]));
  for (int64_t h = 0; h < nh; h += kLaneHeads)
    update_heads(std::min<int64_t>(kLaneHeads, nh - h), s + h, Hp, &w.corr[h], blk, nb, L, &w.acc[h * L]);
}

// One query's nh heads over some of its rows: w.q [nh, L] float32, rows[i] -> the L latent values of selected row i.
// Leaves the online softmax's state (merge_parts makes the result of it): w.acc [nh, L] = sum_i exp(scale * q . row_i
// - w.run_max) row_i, w.run_max [nh] the largest scaled score (-inf without rows), w.run_sum [nh] the weights' sum.
// From kTileMinHeads heads the scores put the heads on the lanes (score_lanes).
template <typename T>
void attend(int64_t nh, int64_t L, const T* const* rows, int64_t n_rows, float scale, FloatScratch& w) {
  const int64_t nv = (nh + kLanes - 1) / kLanes;
  const bool lanes = nh >= kTileMinHeads;
  std::fill(w.acc.begin(), w.acc.end(), 0.0f);
  std::fill(w.run_max.begin(), w.run_max.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.run_sum.begin(), w.run_sum.end(), 0.0f);
  if (lanes)
    for (int64_t v = 0; v < nv; ++v)
      for (int64_t c = 0; c < L; ++c)
        for (int i = 0; i < kLanes; ++i) {
          const int64_t h = v * kLanes + i;
          w.qt[(v * L + c) * kLanes + i] = h < nh ? w.q[h * L + c] : 0.0f;
        }
  const float* blk[kBlock];
  for (int64_t b0 = 0; b0 < n_rows; b0 += kBlock) {
    const int nb = static_cast<int>(std::min<int64_t>(kBlock, n_rows - b0));
    const void* const* next = reinterpret_cast<const void* const*>(rows + b0 + nb);
    const int n_next = static_cast<int>(std::min<int64_t>(kBlock, n_rows - b0 - nb));
    for (int j = 0; j < nb; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        blk[j] = rows[b0 + j];
      } else {
        to_float(rows[b0 + j], &w.row_buf[j * L], L);
        blk[j] = &w.row_buf[j * L];
      }
    }
    if (lanes) {  // the next block's rows requested while this one is scored, one line per lane group
      lanes_block(nh, nv, L, blk, nb, next, n_next, (L * sizeof(T) + 63) / 64, scale, w);
      continue;
    }
    // Few heads: the first rows of the next block requested while this block's last group is scored (float caches;
    // other dtypes are converted into row_buf row by row, which streams them).
    for (int64_t h = 0; h < nh; h += kHeads)
      attend_heads(std::min<int64_t>(kHeads, nh - h), &w.q[h * L], L, blk, nb, next,
                   std::is_same_v<T, float> ? n_next : 0, scale, &w.acc[h * L], &w.run_max[h], &w.run_sum[h]);
  }
}

// Token t's heads of x [T, H, L] (any float dtype, L contiguous) as float32 rows into dst [H, L], and back: src
// [nh, L] into heads [h0, h0 + nh) of out (contiguous), each value rounded once to out's dtype.
void heads_to_float(const at::Tensor& x, int64_t t, float* dst) {
  const int64_t H = x.size(1), L = x.size(2);
  GLM53_DISPATCH_FLOAT_TYPES(x.scalar_type(), "sparse_latent_attention", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>() + t * x.stride(0);
    for (int64_t h = 0; h < H; ++h) to_float(src + h * x.stride(1), dst + h * L, L);
  });
}

// Query t's selected rows (request r's positions idx[t, :], -1 skipped) as pointers into the cache pages; their count.
template <typename T>
int64_t selected_rows(const IndexView& idx, const IndexView& bt, int64_t r, int64_t t, int64_t N, int64_t block_size,
                      int64_t max_blocks, int64_t n_blocks, const T* base, int64_t block_stride, int64_t row_stride,
                      const T** sel, const char* what) {
  int64_t n = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t pos = idx(t, i);
    if (pos < 0) continue;
    TORCH_CHECK(pos / block_size < max_blocks, what, ": position ", pos, " beyond the block table");
    const int64_t blk = bt(r, pos / block_size);
    TORCH_CHECK(blk >= 0 && blk < n_blocks, what, ": block id ", blk, " outside the cache");
    sel[n++] = base + blk * block_stride + (pos % block_size) * row_stride;
  }
  return n;
}

void heads_from_float(const float* src, int64_t t, int64_t h0, int64_t nh, at::Tensor& out) {
  const int64_t H = out.size(1), L = out.size(2);
  GLM53_DISPATCH_FLOAT_TYPES(out.scalar_type(), "sparse_latent_attention", [&] {
    from_float(src, out.data_ptr<scalar_t>() + (t * H + h0) * L, nh * L);
  });
}

// A lone query's rows are split into at most kMaxParts parts (sparse_latent_attention); the float32 path's have at
// least kFloatPartRows rows, two of its online-softmax steps; each thread of their merge reads kMergeValues sums or
// more (256 KiB).
constexpr int64_t kMaxParts = 64;
constexpr int64_t kFloatPartRows = 2 * kBlock;
constexpr int64_t kMergeValues = 1 << 16;

// Heads [h0, h1) of one query from parts of its rows attended separately (attend's or attend_tiles' state of each):
// part k's unnormalised sums acc[k] [H, L] (rows ``ld`` apart), its heads' largest scaled scores m[k] [H] and weight
// sums s[k] [H] (relative to m[k]) -> out [h1 - h0, L]. Each part is weighted by exp(m[k] - max over parts) (0 for a
// part without rows: m = -inf), as the online softmax rescales; one part is its own result, normalised.
void merge_parts(const float* acc, int64_t ld, const float* m, const float* s, int64_t parts, int64_t H, int64_t h0,
                 int64_t h1, int64_t L, float* out) {
  for (int64_t h = h0; h < h1; ++h) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < parts; ++k) top = std::max(top, m[k * H + h]);
    float sum = 0.0f, wk[kMaxParts];
    for (int64_t k = 0; k < parts; ++k) {
      wk[k] = m[k * H + h] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m[k * H + h] - top);
      sum += wk[k] * s[k * H + h];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    float* o = out + (h - h0) * L;
    for (int64_t c = 0; c < L; ++c) {
      float v = wk[0] * acc[h * ld + c];
      for (int64_t k = 1; k < parts; ++k) v += wk[k] * acc[(k * H + h) * ld + c];
      o[c] = v * inv;
    }
  }
}

constexpr int64_t kTileRows = 256;  // rows per online-softmax step on the tiles: a multiple of 32 (the update's K)

#if GLM53_AVX512
// ---- On AMX tiles, or on bfloat16 dot products: bfloat16 queries and cache rows ----
// All heads of a query read the same selected rows (each row is both key and value), so a block of rows is two
// matrix products: the scores S = rows x q (A: 16 rows staged in a copy, 32 latent values a product; B: 16 heads
// in pairs of latent values, token_pairs_into's layout; C: 16 rows x 16 heads) and the update acc += P x rows (A:
// the block's softmax weights, 16 heads x 32 rows, rounded once to bfloat16 as tdpbf16ps takes them; B: the rows
// interleaved in pairs; C: 16 heads x 16 latent values, the running sums, kept in memory). The online softmax runs
// per block of kTileRows rows on vectors of 16 heads; the weights are transposed in registers to heads x rows.
// Products exact, sums in float32 (inputs and results below 2^-126 flushed to zero), so the values differ from the
// float32 path by the weights' rounding and the order of the sums. One tdpbf16ps does 16 x 16 x 32 products where
// an FMA does 16: at the release's 64 heads the float32 path is bound by its arithmetic (~1.6 ms a decode token and
// layer over 2,048 rows on the development machine, where the rows arrive in ~0.1 ms). On the tiles what bounds it
// is moving the operands: each product loads a tile (1 KiB, ~12 ns there, against ~5 ns for the product), two
// products per load at best with eight tiles (amx_block_2x2; benchmarks/README.md).

// Exchange tables of transpose_16x16: for bit k of the lane index, where row r (bit k clear) and row r | 2^k
// take their lanes from (permutex2var: index 16 + i is the second row's lane i).
struct TransposeIndices {
  alignas(64) int32_t low[4][kLanes], high[4][kLanes];
  constexpr TransposeIndices() : low{}, high{} {
    for (int k = 0; k < 4; ++k)
      for (int c = 0; c < kLanes; ++c) {
        const int b = 1 << k;
        low[k][c] = (c & b) ? 16 + c - b : c;
        high[k][c] = (c & b) ? 16 + c : c + b;
      }
  }
};
inline constexpr TransposeIndices kTranspose{};

// r[i][j] -> r[j][i] for a 16 x 16 float32 block in registers: four exchanges, each swapping one bit of the row
// index with the same bit of the lane index (row r and r | 2^k trade the lanes whose bit k differs from theirs).
inline void transpose_16x16(__m512* r) {
  for (int k = 0; k < 4; ++k) {
    const int b = 1 << k;
    const __m512i lo = _mm512_load_si512(kTranspose.low[k]), hi = _mm512_load_si512(kTranspose.high[k]);
    for (int i = 0; i < kLanes; ++i) {
      if (i & b) continue;
      const __m512 x = r[i], y = r[i | b];
      r[i] = _mm512_permutex2var_ps(x, lo, y);
      r[i | b] = _mm512_permutex2var_ps(x, hi, y);
    }
  }
}

// One task's buffers on the tiles, for ``heads`` heads (attend_tiles' nh) in blocks of 16, an even number of blocks
// (an odd count gets a block of zero queries: every product takes two), and a latent of L values padded to Lp. Left
// uninitialised (attend_tiles writes what it reads; zeroing them was a cold call's ~0.7 MB of stores). ``staged``:
// with the copy of the rows as they lie, which only the tiles read (attend_pairs reads the rows in the cache).
struct TileScratch {
  template <typename T>
  using Buffer = std::unique_ptr<T[]>;
  // Rows of the tiles' operands lie ld (4-byte values) or ld16 (bfloat16) apart, one cache line more than their width:
  // at a power of two (2 KiB for the release's latent) a tile's 16 rows fell into two of the L1's sets.
  int64_t blocks, L, Lp, ld, ld16, ldp;
  Buffer<c10::BFloat16> stage;  // [kTileRows, ld16] the block's rows as they lie (A of the scores), if staged
  Buffer<uint32_t> pairs;       // [kTileRows / 2, ld] rows 2i and 2i + 1 interleaved (B of the update)
  Buffer<uint32_t> qp;          // [blocks, Lp / 2, 16] the heads' latent values in pairs (B of the scores)
  Buffer<float> s;              // [blocks, kTileRows, 16] scores, then softmax weights
  Buffer<c10::BFloat16> p;      // [blocks, 16, ldp] the weights, heads as rows (A of the update)
  Buffer<float> acc;            // [blocks * 16, ld] running sums
  Buffer<float> run_max, run_sum;
  TileScratch(int64_t heads, int64_t L_, bool staged)
      : blocks((heads + 2 * kLanes - 1) / (2 * kLanes) * 2), L(L_), Lp((L_ + 31) / 32 * 32), ld(Lp + 16),
        ld16(Lp + 32), ldp(kTileRows + 32), stage(staged ? new c10::BFloat16[kTileRows * ld16] : nullptr),
        pairs(new uint32_t[kTileRows / 2 * ld]), qp(new uint32_t[blocks * Lp / 2 * kLanes]),
        s(new float[blocks * kTileRows * kLanes]), p(new c10::BFloat16[blocks * kLanes * ldp]),
        acc(new float[blocks * kLanes * ld]), run_max(new float[blocks * kLanes]),
        run_sum(new float[blocks * kLanes]) {}
};

constexpr int64_t kScores = kTileRows * kLanes;  // one block of heads' scores in TileScratch::s

// The start of attend_tiles / attend_pairs: the heads' latent values in pairs (the scores' B operand:
// token_pairs_into's layout, zero past the heads and L), the running sums zero, the softmax state empty.
void start_attention(const c10::BFloat16* q, int64_t head_stride, int64_t nh, TileScratch& w) {
  std::fill_n(w.qp.get(), w.blocks * w.Lp / 2 * kLanes, 0u);
  token_pairs_into([&](int64_t h) { return q + h * head_stride; }, nh, w.L, w.Lp / 2, [](int64_t i) { return i; },
                   w.qp.get());
  std::fill_n(w.acc.get(), w.blocks * kLanes * w.ld, 0.0f);
  std::fill_n(w.run_max.get(), w.blocks * kLanes, -std::numeric_limits<float>::infinity());
  std::fill_n(w.run_sum.get(), w.blocks * kLanes, 0.0f);
}

// A block's nc rows (padded: nc rounded up to 32) in the layouts the products read, in one pass: rows 2i and 2i + 1
// interleaved value by value (the update's B operand) and, with Staged, as they lie (the tiles' scores read them as
// A tiles); zero rows past the last up to the products' 32 (a zero weight times a stale row could be NaN) and zero
// columns past L. The selected rows lie at random places, so the pass requests the rows kPairsAhead pairs on while
// it copies a pair (attend_pairs at the release's size, Zen 5: batch 8 3.6-3.8 -> 3.2-3.5 ms, batch 1 ~5 % less;
// 8 pairs ahead the same, 16 less).
constexpr int64_t kPairsAhead = 4;
template <bool Staged>
void lay_out_rows(const c10::BFloat16* const* rows, int64_t nc, int64_t padded, TileScratch& w) {
  const int64_t L = w.L, Lp = w.Lp;
  const __m512i lo_pair = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0),
                hi_pair = _mm512_add_epi16(lo_pair, _mm512_set1_epi16(16));
  for (int64_t i = 0; i < padded / 2; ++i) {
    const c10::BFloat16 *r0 = 2 * i < nc ? rows[2 * i] : nullptr, *r1 = 2 * i + 1 < nc ? rows[2 * i + 1] : nullptr;
    for (int64_t j = 2 * (i + kPairsAhead); j < std::min(nc, 2 * (i + kPairsAhead) + 2); ++j)
      for (int64_t c = 0; c < L; c += 32) __builtin_prefetch(rows[j] + c);
    uint32_t* d = &w.pairs[i * w.ld];
    for (int64_t c = 0; c < Lp; c += 32) {
      const __mmask32 m = c + 32 <= L ? ~__mmask32(0) : __mmask32((1ull << std::max<int64_t>(L - c, 0)) - 1);
      const __m512i x = r0 ? _mm512_maskz_loadu_epi16(m, r0 + c) : _mm512_setzero_si512(),
                    y = r1 ? _mm512_maskz_loadu_epi16(m, r1 + c) : _mm512_setzero_si512();
      if constexpr (Staged) {
        c10::BFloat16* s0 = &w.stage[2 * i * w.ld16];
        _mm512_storeu_si512(s0 + c, x);
        _mm512_storeu_si512(s0 + w.ld16 + c, y);
      }
      _mm512_storeu_si512(d + c, _mm512_permutex2var_epi16(x, lo_pair, y));
      _mm512_storeu_si512(d + c + 16, _mm512_permutex2var_epi16(x, hi_pair, y));
    }
  }
}

// The online softmax of a block of nc rows whose scores (unscaled, [blocks, kTileRows, 16]: rows x 16 heads) are in
// w.s, on vectors of 16 heads: the weights, transposed to heads x rows in bfloat16 (the update's A operand), into
// w.p, zero past nc up to padded; the running maxima and sums updated, and the running sums of the heads whose
// maximum rose rescaled (``first``: the first block, whose sums are still zero).
void softmax_block(int64_t nc, int64_t padded, float scale, bool first, TileScratch& w) {
  for (int64_t b = 0; b < w.blocks; ++b) {
    float* sb = &w.s[b * kScores];
    alignas(64) float corr[kLanes];
    store(corr, softmax_rows(sb, kLanes, nc, scale, &w.run_max[b * kLanes], &w.run_sum[b * kLanes]));
    std::fill(sb + nc * kLanes, sb + padded * kLanes, 0.0f);
    for (int64_t g = 0; g < padded; g += kLanes) {
      __m512 r[kLanes];
      for (int i = 0; i < kLanes; ++i) r[i] = _mm512_loadu_ps(sb + (g + i) * kLanes);
      transpose_16x16(r);
      for (int h = 0; h < kLanes; ++h) store(&w.p[(b * kLanes + h) * w.ldp + g], F16{r[h]});
    }
    if (!first)
      for (int h = 0; h < kLanes; ++h) {
        if (corr[h] == 1.0f) continue;
        float* a = &w.acc[(b * kLanes + h) * w.ld];
        for (int64_t c = 0; c < w.Lp; c += kLanes) store(a + c, load(a + c) * set1(corr[h]));
      }
  }
}

#if GLM53_HAS_AMX
// attend() for nh heads of bfloat16 queries (q: head h's L values at q + h * head_stride) over bfloat16 rows, on the
// tiles (configured by the caller), short of the normalisation: leaves head h's sums of weight x row in w.acc[h * ld,
// + L) and its softmax state (the largest scaled score, the sum of the weights relative to it) in w.run_max[h] and
// w.run_sum[h], from which merge_parts takes the result (of one part, or of parts of one query's rows).
GLM53_AMX void attend_tiles(const c10::BFloat16* q, int64_t head_stride, int64_t nh, const c10::BFloat16* const* rows,
                            int64_t n_rows, float scale, TileScratch& w) {
  const int64_t Lp = w.Lp, ld = w.ld, ld16 = w.ld16, ldp = w.ldp, blocks = w.blocks, per_block = Lp / 2 * kLanes;
  start_attention(q, head_stride, nh, w);
  for (int64_t b0 = 0; b0 < n_rows; b0 += kTileRows) {
    const int64_t nc = std::min(kTileRows, n_rows - b0), padded = (nc + 31) / 32 * 32;
    lay_out_rows<true>(rows + b0, nc, padded, w);
    // Scores: 32 rows x two blocks of heads per group of products.
    for (int64_t g = 0; g < padded; g += 32)
      for (int64_t b = 0; b < blocks; b += 2) {
        float* c = &w.s[b * kScores + g * kLanes];
        amx_block_2x2<false>(&w.stage[g * ld16], &w.stage[(g + 16) * ld16], ld16 * 2, &w.qp[b * per_block],
                             &w.qp[(b + 1) * per_block], 64, Lp / 32, c, c + kScores, c + 16 * kLanes,
                             c + kScores + 16 * kLanes, kLanes * sizeof(float));
      }
    softmax_block(nc, padded, scale, b0 == 0, w);
    // acc += P x rows: two blocks of heads x two blocks of 16 latent values per group of products.
    const int64_t a_bytes = ldp * sizeof(c10::BFloat16), c_bytes = ld * sizeof(float);
    for (int64_t b = 0; b < blocks; b += 2) {
      const c10::BFloat16* a = &w.p[b * kLanes * ldp];
      float* c = &w.acc[b * kLanes * ld];
      for (int64_t cb = 0; cb < Lp; cb += 2 * kLanes)
        amx_block_2x2<true>(a, a + kLanes * ldp, a_bytes, &w.pairs[cb], &w.pairs[cb + kLanes], ld * sizeof(uint32_t),
                            padded / 32, c + cb, c + cb + kLanes, c + kLanes * ld + cb, c + kLanes * ld + cb + kLanes,
                            c_bytes);
    }
  }
}
#endif

// attend_tiles' products on bfloat16 dot products, for a CPU with AVX512_BF16 and no AMX tiles (AMD from Zen 4):
// vdpbf16ps rounds and sums as tdpbf16ps, so the values differ from the tiles' only by the order of the sums. The
// scores: G rows x two blocks of 16 heads in registers, each row's latent pair broadcast against the heads' pairs
// (the indexer's score_pools_pairs); the update: kUpdateHeads heads x CU vectors of 16 latent values of the running
// sums in registers over the block, each head's pair of weights broadcast against the interleaved rows. 32 products
// an instruction where the float32 path's FMA takes 16, with no widening of the rows: at the release's 64 heads that
// path is bound by its multiply-adds. Release's size (64 heads, 2,051 rows, latent 512), Zen 5, 2 threads, cold:
// batch 1 1.05-1.35 -> 0.53-0.58 ms, batch 8 7.0-7.6 -> 3.6-4.0 ms (before the rows were requested ahead; with it
// 3.2-3.5: benchmarks/README.md).
constexpr int kScoreRows = 8;    // rows a pass of the scores: 16 accumulators with two blocks of heads
constexpr int kUpdateHeads = 4;  // heads a pass of the update: 16 accumulators with 4 vectors of latent values

// w.s[b + j] (scores of G rows from ``rows``, the two blocks of heads whose pairs start at qp, per_block apart) for
// the first n <= G of them, over the latent's P channel pairs.
template <int G>
[[gnu::always_inline]] GLM53_BF16_DOT inline void score_rows(const c10::BFloat16* const* rows, int n,
                                                             const uint32_t* qp, int64_t per_block, int64_t P,
                                                             float* s) {
  __m512 acc[G][2];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    const __m512i q0 = _mm512_loadu_si512(qp + p * kLanes), q1 = _mm512_loadu_si512(qp + per_block + p * kLanes);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      uint32_t pair;
      std::memcpy(&pair, rows[g] + 2 * p, sizeof(pair));
      const __m512i x = _mm512_set1_epi32(static_cast<int>(pair));
      acc[g][0] = dot_pairs(acc[g][0], q0, x);
      acc[g][1] = dot_pairs(acc[g][1], q1, x);
    }
  }
  for (int g = 0; g < n; ++g) {
    _mm512_storeu_ps(s + g * kLanes, acc[g][0]);
    _mm512_storeu_ps(s + kScores + g * kLanes, acc[g][1]);
  }
}

// w.acc rows h0 .. h0 + kUpdateHeads, vectors c0 .. c0 + CU of 16 latent values: += the block's weights (w.p) x its
// interleaved rows (w.pairs), over ``pairs`` row pairs.
template <int CU>
[[gnu::always_inline]] GLM53_BF16_DOT inline void update_heads(TileScratch& w, int64_t h0, int64_t c0, int64_t pairs) {
  __m512 acc[kUpdateHeads][CU];
#pragma GCC unroll 4
  for (int h = 0; h < kUpdateHeads; ++h)
#pragma GCC unroll 4
    for (int u = 0; u < CU; ++u) acc[h][u] = _mm512_loadu_ps(&w.acc[(h0 + h) * w.ld + c0 + u * kLanes]);
  for (int64_t i = 0; i < pairs; ++i) {
    __m512i r[CU];
#pragma GCC unroll 4
    for (int u = 0; u < CU; ++u) r[u] = _mm512_loadu_si512(&w.pairs[i * w.ld + c0 + u * kLanes]);
#pragma GCC unroll 4
    for (int h = 0; h < kUpdateHeads; ++h) {
      uint32_t pw;
      std::memcpy(&pw, &w.p[(h0 + h) * w.ldp + 2 * i], sizeof(pw));
      const __m512i x = _mm512_set1_epi32(static_cast<int>(pw));
#pragma GCC unroll 4
      for (int u = 0; u < CU; ++u) acc[h][u] = dot_pairs(acc[h][u], x, r[u]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < kUpdateHeads; ++h)
#pragma GCC unroll 4
    for (int u = 0; u < CU; ++u) _mm512_storeu_ps(&w.acc[(h0 + h) * w.ld + c0 + u * kLanes], acc[h][u]);
}

// attend_tiles (see there: the same scratch, state and result) on bfloat16 dot products. L even.
[[gnu::noinline]] GLM53_BF16_DOT void attend_pairs(const c10::BFloat16* q, int64_t head_stride, int64_t nh,
                                                   const c10::BFloat16* const* rows, int64_t n_rows, float scale,
                                                   TileScratch& w) {
  const int64_t P = w.L / 2, per_block = w.Lp / 2 * kLanes;
  start_attention(q, head_stride, nh, w);
  for (int64_t b0 = 0; b0 < n_rows; b0 += kTileRows) {
    const c10::BFloat16* const* blk = rows + b0;
    const int64_t nc = std::min(kTileRows, n_rows - b0), padded = (nc + 31) / 32 * 32;
    lay_out_rows<false>(blk, nc, padded, w);
    // Scores of the rows as they lie (pairs of channels < L only: the cache row goes on past the latent).
    for (int64_t j = 0; j < nc; j += kScoreRows) {
      const int n = static_cast<int>(std::min<int64_t>(kScoreRows, nc - j));
      const c10::BFloat16* group[kScoreRows];
      for (int g = 0; g < kScoreRows; ++g) group[g] = blk[j + std::min(g, n - 1)];  // a short group repeats its last
      for (int64_t b = 0; b < w.blocks; b += 2)
        score_rows<kScoreRows>(group, n, &w.qp[b * per_block], per_block, P, &w.s[b * kScores + j * kLanes]);
    }
    softmax_block(nc, padded, scale, b0 == 0, w);
    // acc += P x rows over the block's row pairs (the padding's weights and rows are zero).
    for (int64_t h0 = 0; h0 < w.blocks * kLanes; h0 += kUpdateHeads) {
      int64_t c0 = 0;
      for (; c0 + 4 * kLanes <= w.Lp; c0 += 4 * kLanes) update_heads<4>(w, h0, c0, padded / 2);
      for (; c0 < w.Lp; c0 += 2 * kLanes) update_heads<2>(w, h0, c0, padded / 2);
    }
  }
}

#endif

}  // namespace

// q_lat [T, H, L] (float32 / bfloat16 / float16); rows [num_blocks, block_size, R] the paged cache (float32 / bfloat16 /
// float16, rows contiguous) whose first ``latent_dim`` values are the latent; block_table [num_reqs,
// max_blocks]; query_start_loc [num_reqs + 1]; indices [T, N] positions within the query's request, -1 unused
// (the index tensors int32 or int64, any strides). Returns o_lat [T, H, L] in q_lat's dtype (softmax and
// accumulation in float32, each output value rounded once). No torch op runs before the attention: each task
// widens its own query heads and narrows its own outputs, and the index tensors are read where they lie (the
// conversions of the queries, the output and the plan's int32 tensors were 10-17 % of a cold decode call at the
// kernel-friendly size: benchmarks/README.md).
at::Tensor sparse_latent_attention(const at::Tensor& q_lat, const at::Tensor& rows, const at::Tensor& block_table_,
                                   const at::Tensor& query_start_loc_, const at::Tensor& indices_, double scale_,
                                   int64_t latent_dim) {
  const char* what = "sparse_latent_attention";
  TORCH_CHECK(rows.dim() == 3 && rows.stride(2) == 1, what, ": rows must be [blocks, size, R]");
  TORCH_CHECK(q_lat.dim() == 3, what, ": q_lat must be [T, H, L]");
  TORCH_CHECK(q_lat.scalar_type() == at::kFloat || q_lat.scalar_type() == at::kBFloat16 ||
                  q_lat.scalar_type() == at::kHalf,
              what, ": q_lat must be float32, bfloat16 or float16, got ", q_lat.scalar_type());
  const int64_t T = q_lat.size(0), H = q_lat.size(1), L = q_lat.size(2);
  TORCH_CHECK(L == latent_dim && latent_dim <= rows.size(2), what, ": latent width mismatch");
  TORCH_CHECK(rows.size(1) > 0, what, ": empty cache pages");
  TORCH_CHECK(indices_.dim() == 2 && indices_.size(0) == T, what, ": indices must be [T, N]");
  TORCH_CHECK(block_table_.dim() == 2, what, ": block_table must be [num_reqs, max_blocks]");
  TORCH_CHECK(query_start_loc_.dim() == 1 && query_start_loc_.size(0) >= 1, what,
              ": query_start_loc must be [num_reqs + 1]");
  const at::Tensor q = q_lat.stride(2) == 1 ? q_lat : q_lat.contiguous();
  const IndexView idx(indices_, what, "indices"), bt(block_table_, what, "block_table");
  const int64_t n_req = query_start_loc_.size(0) - 1;
  const std::vector<int64_t> qs = query_starts(query_start_loc_, n_req, T, true, block_table_, what);
  const int64_t N = indices_.size(1), block_size = rows.size(1), n_blocks = rows.size(0),
                max_blocks = block_table_.size(1);
  const float scale = static_cast<float>(scale_);
  at::Tensor out = at::empty({T, H, L}, q_lat.options());
  if (T == 0) return out;

  // Request of each query.
  std::vector<int64_t> req(T);
  for (int64_t r = 0; r < n_req; ++r)
    for (int64_t t = qs[r]; t < qs[r + 1]; ++t) req[t] = r;

  // bfloat16 queries and rows from kTileMinHeads heads multiply on AMX tiles where the kernels use them, else on
  // bfloat16 dot products where the CPU has them, in the tiles' form (attend_pairs).
  const bool bf16_products = q.scalar_type() == at::kBFloat16 && rows.scalar_type() == at::kBFloat16 && L % 2 == 0 &&
                             H >= kTileMinHeads;
  const bool tiles = GLM53_HAS_AMX && amx_tiles() && bf16_products;
#if GLM53_AVX512
  const bool pairs = bf16_products && !tiles && has_bf16_dot();
#else
  const bool pairs = false;
#endif
  // Enough tasks for every thread where there are fewer queries than threads: a query's rows are split into parts,
  // each task one part with all the heads, merged after (merge_parts), so a lone query's values depend on the threads
  // (in the last bits). Split heads instead, every task would read, widen or lay out all the rows for fewer heads,
  // and the float32 path's vectors of 16 heads would run part-empty (64 heads on 16 threads: 4 heads a task, each
  // task the arithmetic of 16). A part has at least kTileRows rows on the products (their softmax step), else
  // kFloatPartRows.
  const bool products = tiles || pairs;
  const int64_t threads = at::get_num_threads(), min_rows = products ? kTileRows : kFloatPartRows;
  const int64_t parts =
      T < threads ? std::clamp<int64_t>(std::min((threads + T - 1) / T, N / min_rows), 1, kMaxParts) : 1;
  // A task's part of its query's n_sel selected rows: [lo, hi).
  const auto part_rows = [&](int64_t task, int64_t n_sel) {
    const int64_t per_part = (n_sel + parts - 1) / parts, lo = std::min(n_sel, task % parts * per_part);
    return std::pair<int64_t, int64_t>{lo, std::min(n_sel, lo + per_part)};
  };
  // Parts' states (parts > 1): sums [T, parts, H, L], maxima and weight sums [T, parts, H]; each task writes its own
  // before the merge reads them (not zeroed: a lone query's can be MiBs, which one thread would clear).
  const int64_t n_part_heads = parts > 1 ? T * parts * H : 0;
  std::unique_ptr<float[]> part_acc(new float[n_part_heads * L]), part_max(new float[n_part_heads]),
      part_sum(new float[n_part_heads]);
  // A task's state (sums ``ld`` apart): its query's result when it is the only part, else its part's entries.
  const auto finish = [&](int64_t task, const float* acc, int64_t ld, const float* run_max, const float* run_sum,
                          float* of) {
    if (parts == 1) {
      merge_parts(acc, ld, run_max, run_sum, 1, H, 0, H, L, of);
      heads_from_float(of, task, 0, H, out);  // one part a query: the task is the query
      return;
    }
    for (int64_t h = 0; h < H; ++h) std::memcpy(&part_acc[(task * H + h) * L], acc + h * ld, L * sizeof(float));
    std::copy_n(run_max, H, &part_max[task * H]);
    std::copy_n(run_sum, H, &part_sum[task * H]);
  };

#if GLM53_AVX512
  if (products) {
    const auto* base = rows.data_ptr<c10::BFloat16>();
    const auto* qb = q.data_ptr<c10::BFloat16>();
    at::parallel_for(0, T * parts, 1, [&](int64_t begin, int64_t end) {
      std::vector<const c10::BFloat16*> sel(N);
      std::vector<float> of(H * L);
      TileScratch scratch(H, L, tiles);
#if GLM53_HAS_AMX
      if (tiles) amx_configure();
#endif
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t = task / parts;
        const int64_t n_sel = selected_rows(idx, bt, req[t], t, N, block_size, max_blocks, n_blocks, base,
                                            rows.stride(0), rows.stride(1), sel.data(), what);
        const auto [lo, hi] = part_rows(task, n_sel);
#if GLM53_HAS_AMX
        if (tiles) attend_tiles(qb + t * q.stride(0), q.stride(1), H, sel.data() + lo, hi - lo, scale, scratch);
#endif
        if (pairs) attend_pairs(qb + t * q.stride(0), q.stride(1), H, sel.data() + lo, hi - lo, scale, scratch);
        finish(task, scratch.acc.get(), scratch.ld, scratch.run_max.get(), scratch.run_sum.get(), of.data());
      }
#if GLM53_HAS_AMX
      if (tiles) amx_release();
#endif
    });
  }
#endif
  if (!products)
    GLM53_DISPATCH_FLOAT_TYPES(rows.scalar_type(), what, [&] {
      const scalar_t* base = rows.data_ptr<scalar_t>();
      at::parallel_for(0, T * parts, 1, [&](int64_t begin, int64_t end) {
        std::vector<const scalar_t*> sel(N);
        FloatScratch scratch(H, L);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t t = task / parts;
          const int64_t n_sel = selected_rows(idx, bt, req[t], t, N, block_size, max_blocks, n_blocks, base,
                                              rows.stride(0), rows.stride(1), sel.data(), what);
          const auto [lo, hi] = part_rows(task, n_sel);
          heads_to_float(q, t, scratch.q.data());
          attend(H, L, sel.data() + lo, hi - lo, scale, scratch);
          finish(task, scratch.acc.data(), L, scratch.run_max.data(), scratch.run_sum.data(), scratch.out.data());
        }
      });
    });
  // The parts' merge, split by (query, head) between the threads where each reads kMergeValues sums or more (fewer,
  // and another parallel region costs more than it saves).
  if (parts > 1)
    at::parallel_for(0, T * H, (kMergeValues + parts * L - 1) / (parts * L), [&](int64_t begin, int64_t end) {
      std::vector<float> of(L);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / H, h = i % H;
        merge_parts(&part_acc[t * parts * H * L], L, &part_max[t * parts * H], &part_sum[t * parts * H], parts, H, h,
                    h + 1, L, of.data());
        heads_from_float(of.data(), t, h, 1, out);
      }
    });
  return out;
}

// The step's cache writes (the contract of vllm_glm53/backends/pages.py's write_tokens_torch, the reference): token t's
// latent row into latent_pages [blocks, block_size, L] at slot_mapping[t] (block * block_size + offset; -1: not
// stored) and, given key_gate [T, 2 dI], its raw indexer inputs into raw [blocks, raw_pools, kp - 1, 2 dI] where a
// later step may still read them: offset % kp < kp - 1 (the pool's last token is compressed, never read raw) and
// the pool among the last raw_pools pools the step writes in its page. A page being written belongs to one
// request, whose tokens are consecutive in the batch, so the last pool of a run of tokens in one block is the
// page's. Rows are copied as they are: the caller converts them to the cache dtype. One call instead of the
// reference's ~20 tensor ops: a decode step's writes took 55 us there, 3.3 us here through the op dispatch.
void write_tokens(at::Tensor& latent_pages, at::Tensor& raw, const at::Tensor& slot_mapping,
                  const at::Tensor& latent_, const std::optional<at::Tensor>& key_gate_) {
  const char* what = "write_tokens";
  TORCH_CHECK(latent_pages.dim() == 3 && latent_pages.stride(2) == 1, what,
              ": latent pages must be [blocks, block_size, L] with contiguous rows");
  TORCH_CHECK(raw.dim() == 4 && raw.stride(3) == 1 && raw.size(0) == latent_pages.size(0), what,
              ": raw must be [blocks, raw_pools, kp - 1, 2 dI] with contiguous rows, one per page");
  TORCH_CHECK(raw.scalar_type() == latent_pages.scalar_type(), what, ": latent and raw regions differ in dtype");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = slots.size(0), n_blocks = latent_pages.size(0), bs = latent_pages.size(1),
                L = latent_pages.size(2), n_slots = raw.size(1), kp = raw.size(2) + 1, W = raw.size(3);
  TORCH_CHECK(bs % kp == 0, what, ": block size ", bs, " is not a multiple of the pool size ", kp);
  const auto rows_of = [&](const at::Tensor& t, int64_t width, const char* name) {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == T && t.size(1) == width, what, ": ", name, " must be [", T, ", ",
                width, "], got ", t.sizes());
    at::Tensor r = t.to(latent_pages.scalar_type());
    return r.stride(1) == 1 ? r : r.contiguous();
  };
  const at::Tensor latent = rows_of(latent_, L, "latent");
  const at::Tensor key_gate = key_gate_.has_value() ? rows_of(*key_gate_, W, "key_gate") : at::Tensor();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t es = latent_pages.element_size();

  struct Copy {
    const char* src;
    char* dst;
    int64_t bytes;
  };
  std::vector<int64_t> valid;  // batch rows that are stored, in batch order
  for (int64_t t = 0; t < T; ++t) {
    if (sp[t] < 0) continue;
    TORCH_CHECK(sp[t] < n_blocks * bs, what, ": slot ", sp[t], " outside the cache (", n_blocks, " blocks of ", bs,
                ")");
    valid.push_back(t);
  }
  std::vector<Copy> copies;
  copies.reserve(2 * valid.size());
  char* lbase = static_cast<char*>(latent_pages.data_ptr());
  const char* lsrc = static_cast<const char*>(latent.data_ptr());
  for (const int64_t t : valid)
    copies.push_back({lsrc + t * latent.stride(0) * es,
                      lbase + ((sp[t] / bs) * latent_pages.stride(0) + (sp[t] % bs) * latent_pages.stride(1)) * es,
                      L * es});
  if (key_gate.defined()) {
    char* rbase = static_cast<char*>(raw.data_ptr());
    const char* ksrc = static_cast<const char*>(key_gate.data_ptr());
    int64_t last_pool = 0;  // of the run of tokens in this token's block (walked backwards)
    for (int64_t i = static_cast<int64_t>(valid.size()) - 1; i >= 0; --i) {
      const int64_t t = valid[i], blk = sp[t] / bs, off = sp[t] % bs, pool = off / kp, j = off % kp;
      if (i + 1 == static_cast<int64_t>(valid.size()) || sp[valid[i + 1]] / bs != blk) last_pool = pool;
      if (j < kp - 1 && pool > last_pool - n_slots)
        copies.push_back({ksrc + t * key_gate.stride(0) * es,
                          rbase + (blk * raw.stride(0) + (pool % n_slots) * raw.stride(1) + j * raw.stride(2)) * es,
                          W * es});
    }
  }
  // Distinct slots: no two copies share a destination.
  at::parallel_for(0, static_cast<int64_t>(copies.size()), 256, [&](int64_t i, int64_t end) {
    for (; i < end; ++i) std::memcpy(copies[i].dst, copies[i].src, copies[i].bytes);
  });
}

// The absorbed MLA's per-head products (sparse_mla.py absorb_q / apply_uv) on AMX tiles: out[t, h] = W[h] x[t, h]
// for bfloat16 tokens x [T, H, K] (unit stride along K) and each head's weight W[h] [N, K], given as ``tiles``
// [H, N/16, K/32, 16, 16, 2] (sparse_mla.py head_tiles: per block of 16 outputs and 32 inputs, the tile B
// that tdpbf16ps takes, input pairs down the rows, outputs across, 1 KiB each, in the order they are read). A tile
// = 16 tokens x 32 inputs from a copy of the group's tokens; C = 16 tokens x 16 outputs, float32 sums
// (exact products), rounded to bfloat16 once. The weights stream in order, the next 2 KiB requested into the L2
// during each product: torch's batched GEMM (oneDNN) on a decode step's 1 MiB of these weights took ~2.2x the time,
// cold (the read, then its arithmetic, with nothing in flight meanwhile; benchmarks/README.md).
#if GLM53_HAS_AMX
namespace {
// One head and group of n <= 16 tokens: a [16, K] holds their rows, w the head's tiles; writes out's
// rows t < n (``ld`` values apart), N = NB * 16 values each.
GLM53_AMX void head_group(const c10::BFloat16* a, int64_t K, const char* w, int64_t NB, int64_t n, c10::BFloat16* out,
                          int64_t ld) {
  constexpr int64_t kTileBytes = 1024, kAhead = 2048;
  alignas(64) float c[kLanes][kLanes];
  const int64_t KB = K / 32;
  for (int64_t nb = 0; nb < NB; ++nb) {
    _tile_zero(0);
    for (int64_t kb = 0; kb < KB; ++kb) {
      const char* b = w + (nb * KB + kb) * kTileBytes;
      for (int64_t l = 0; l < kTileBytes; l += 64) __builtin_prefetch(b + kAhead + l, 0, 1);
      _tile_loadd(2, a + kb * 32, K * sizeof(c10::BFloat16));
      _tile_loadd(4, b, 64);
      _tile_dpbf16ps(0, 2, 4);
    }
    _tile_stored(0, c, kLanes * sizeof(float));
    for (int64_t t = 0; t < n; ++t) store(out + t * ld + nb * kLanes, load(c[t]));
  }
}
}  // namespace
#endif

at::Tensor head_products(const at::Tensor& x, const at::Tensor& tiles, int64_t N) {
#if GLM53_HAS_AMX
  TORCH_CHECK(amx_tiles(), "head_products: needs AMX tiles");
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1,
              "head_products: x must be bfloat16 [T, H, K] with unit stride along K");
  const int64_t T = x.size(0), H = x.size(1), K = x.size(2);
  TORCH_CHECK(tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous() && K % 32 == 0 && N % 16 == 0 &&
                  tiles.numel() == H * N * K,
              "head_products: tiles must be head_tiles' bfloat16 [H, N/16, K/32, 16, 16, 2] for K = ", K, ", N = ", N);
  at::Tensor out = at::empty({T, H, N}, x.options());
  if (T == 0) return out;
  const int64_t groups = (T + kLanes - 1) / kLanes, NB = N / kLanes;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const char* wp = static_cast<const char*>(tiles.data_ptr());
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, H * groups, 1, [&](int64_t i, int64_t end) {
    std::vector<c10::BFloat16> a(kLanes * K);
    amx_configure();
    for (; i < end; ++i) {
      const int64_t h = i / groups, t0 = i % groups * kLanes, n = std::min<int64_t>(kLanes, T - t0);
      for (int64_t t = 0; t < n; ++t)  // (rows past n, left from before, only reach C rows that are not stored)
        std::memcpy(&a[t * K], xp + (t0 + t) * x.stride(0) + h * x.stride(1), K * sizeof(c10::BFloat16));
      head_group(a.data(), K, wp + h * N * K * sizeof(c10::BFloat16), NB, n, op + (t0 * H + h) * N, H * N);
    }
    amx_release();
  });
  return out;
#else
  (void)x, (void)tiles, (void)N;
  TORCH_CHECK(false, "head_products: needs the avx512 kernels on a CPU with AMX tiles");
#endif
}

}  // namespace glm53
