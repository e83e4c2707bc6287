// Lightning indexer with k-pool compression on CPU: pool compression, pool scores and top-k selection, per
// sequence (the contracts of vllm_glm53/backends/cpu/indexer.py) and fused over a batch read straight from
// the paged latent cache (page layout: vllm_glm53/backends/latent_cache.py): a pool's compressed key is stored
// when its last token is written (store_pooled_keys), and the selection reads a page's pooled keys, contiguous,
// as one stream (indexer_select).
//
// Exact ties between pool scores are common (ReLU makes many scores exactly 0) and transformers breaks them
// with torch.topk over its row layout, so where a tie crosses the cut (the k-th largest score equals one left
// out) selection here calls the very same at::topk on the same row layout (``ceil(seq_len / kp)`` columns,
// non-candidates at float32's lowest value); elsewhere the chosen set is the same for any top-k, and one pass
// finds it (top_set). at::topk's choice depends only on the order relations inside a row: scores that differ from
// the torch backend's by rounding alone select the same pools.

#include "common.h"
#include "gemv.h"  // token_pairs_into, amx.h

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>


namespace glm53 {
namespace {

constexpr float kLowest = std::numeric_limits<float>::lowest();
constexpr int64_t kMaxPool = 64;     // largest supported kp (stack space for one pool's softmax)

// The register tile of the lanes loop (score_head_block): kKeysPerPass keys times kHeadVectors vectors of kLanes
// heads in accumulators, beside a qT row's kHeadVectors vectors and one broadcast key channel. AVX-512 (32
// registers): 8 keys x 2 vectors, 16 accumulators (12 x 2 measured no faster). AVX2 (16 ymm, two to a vector): 6
// keys x 1 vector, 12 ymm of accumulators + 2 for the qT row + 1 broadcast. 2 keys x 2 vectors fit too, but their
// 8 accumulators only just cover the FMAs' latency (two pipes, 4 cycles) and they load 10 values per 8 FMAs where
// this loads 8 per 12: batch 8, 32 heads, as an AVX2 CPU, both tiles in one process, cold calls, a bfloat16 cache
// 2.15-2.24 -> 1.67-1.72 ms at 16K context and 0.55-0.65 -> 0.44-0.54 ms at 4K; a float32 cache 2-10 % faster.
#if GLM53_AVX2
constexpr int kKeysPerPass = 6;
constexpr int kHeadVectors = 1;
#else
constexpr int kKeysPerPass = kVectorRegs / 4;  // with two vectors of heads: half the registers hold accumulators
constexpr int kHeadVectors = 2;
#endif
// Pools per work item in the fused batch op: about 32, whole passes of the tile.
constexpr int64_t kPoolChunk = (32 + kKeysPerPass - 1) / kKeysPerPass * kKeysPerPass;

// K[c] = sum_j softmax_j(gate_j[c] + ape[j, c]) * key_j[c] for one pool; key[j] / gate[j] are its kp rows.
template <typename T>
void compress_pool(const T* const* key, const T* const* gate, const float* ape, int64_t kp, int64_t dI, float* out) {
  F16 e[kMaxPool];
  for (int64_t c = 0; c < dI; c += kLanes) {
    const int m = static_cast<int>(std::min<int64_t>(kLanes, dI - c));
    F16 mx = set1(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < kp; ++j) {
      e[j] = load(gate[j] + c, m) + load(ape + j * dI + c, m);
      mx = vmax(mx, e[j]);
    }
    F16 sum = zero();
    for (int64_t j = 0; j < kp; ++j) {
      e[j] = exp(e[j] - mx);
      sum = sum + e[j];
    }
    F16 acc = zero();
    for (int64_t j = 0; j < kp; ++j) acc = fma(e[j] / sum, load(key[j] + c, m), acc);
    store(out + c, acc, m);
  }
}

// sum_h w[h] * relu(scale * q[h] . K) with q [nI, dI] and w [nI] float32.
template <typename T>
inline float pool_score(const T* K, const float* q, const float* w, int64_t nI, int64_t dI, float scale) {
  float s = 0.0f;
  for (int64_t h = 0; h < nI; ++h) s += w[h] * std::max(scale * dot(q + h * dI, K, dI), 0.0f);
  return s;
}

// Asks for the cache lines of one key of dI values: into the L1 (the caller reads it next), or with Locality 1 into
// the L2 (prefetcht2: the request then holds an entry of the L2's longer miss queue instead of one of the L1's few
// line fill buffers until memory answers; score_pools_tiles, Intel only).
template <int Locality = 3, typename T>
inline void request_key(const T* key, int64_t dI) {
  const char* p = reinterpret_cast<const char*>(key);
  for (int64_t b = 0; b < dI * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, Locality);
}

// out[i] = sum_h w[h] * relu(scale * q[h] . keys[i]) for n pools, q [nI, dI] and w [nI] float32, for fewer heads
// than a vector has lanes. Each pass over a key's channels serves four heads (one key load feeds four products; a
// (pool, head) sum is one accumulator in channel order, as pool_score's heads are added in head order). While pool i
// is scored, the lines of ahead[i] (i < n_ahead: the keys the caller scores next) are requested, so that their
// reads spread over this chunk's arithmetic: cold calls wait on memory, and a burst of a whole chunk's requests up
// front overlaps less (measured).
template <typename T>
void score_pools(const T* const* keys, int64_t n, const T* const* ahead, int64_t n_ahead, const float* q,
                 const float* w, int64_t nI, int64_t dI, float scale, float* out) {
  auto head_term = [&](int64_t h, F16 acc) { return w[h] * std::max(scale * reduce_add(acc), 0.0f); };
  for (int64_t i = 0; i < n; ++i) {
    if (i < n_ahead) request_key(ahead[i], dI);
    const T* key = keys[i];
    float s = 0.0f;
    int64_t h = 0;
    for (; h + 4 <= nI; h += 4) {
      const float* qh = q + h * dI;
      F16 a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
      for (int64_t c = 0; c < dI; c += kLanes) {
        const int m = static_cast<int>(std::min<int64_t>(kLanes, dI - c));
        const F16 x = load(key + c, m);
        a0 = fma(load(qh + c, m), x, a0);
        a1 = fma(load(qh + dI + c, m), x, a1);
        a2 = fma(load(qh + 2 * dI + c, m), x, a2);
        a3 = fma(load(qh + 3 * dI + c, m), x, a3);
      }
      s += head_term(h, a0);
      s += head_term(h + 1, a1);
      s += head_term(h + 2, a2);
      s += head_term(h + 3, a3);
    }
    for (; h < nI; ++h) {
      F16 a = zero();
      for (int64_t c = 0; c < dI; c += kLanes) {
        const int m = static_cast<int>(std::min<int64_t>(kLanes, dI - c));
        a = fma(load(q + h * dI + c, m), load(key + c, m), a);
      }
      s += head_term(h, a);
    }
    out[i] = s;
  }
  for (int64_t i = n; i < n_ahead; ++i) request_key(ahead[i], dI);
}

// From kLanes heads on (the release has 32) the heads lie along the lanes instead: the query is transposed once
// per token (qT [dI, nIp], heads padded with zeros to nIp, a multiple of kLanes; w [nIp] likewise), and each key
// channel, broadcast, multiplies a channel row of qT into its heads' accumulators. A pool then costs one
// horizontal sum per block of heads instead of one per head (those sums and the per-head scalar ReLU and
// weighting were a third of the scoring loop's time with four heads, and grow with the heads), and the ReLU and
// weighting run on whole vectors. kKeysPerPass keys share each qT row load (the tile: top of the file); a (pool,
// head) dot product is summed in channel order.

// s[g] += sum over a block's heads of w[h] * relu(scale * acc[g][h]), acc[g] the G keys' dot products with HB
// vectors of heads: the ReLU and weighting in vectors, then one horizontal sum per key.
template <int HB, int G>
[[gnu::always_inline]] inline void add_head_block(const F16 (&acc)[G][HB], float scale, const float* w, float* s) {
  const F16 sc = set1(scale);
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) {
    F16 t = relu(acc[g][0] * sc) * load(w);
#pragma GCC unroll 4
    for (int b = 1; b < HB; ++b) t = t + relu(acc[g][b] * sc) * load(w + b * kLanes);
    s[g] += reduce_add(t);
  }
}

// s[g] += sum over the block's heads of w[h] * relu(scale * qT[:, h] . kf[g]), HB vectors of heads.
template <int HB, int G>
inline void score_head_block(const float* const* kf, const float* qT, int64_t nIp, int64_t dI, float scale,
                             const float* w, float* s) {
  // Unrolled, so that the accumulators live in registers (rolled loops kept them in the stack frame).
  F16 acc[G][HB];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < HB; ++b) acc[g][b] = zero();
  for (int64_t d = 0; d < dI; ++d) {
    F16 qd[HB];
#pragma GCC unroll 4
    for (int b = 0; b < HB; ++b) qd[b] = load(qT + d * nIp + b * kLanes);
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const F16 x = set1(kf[g][d]);
#pragma GCC unroll 4
      for (int b = 0; b < HB; ++b) acc[g][b] = fma(qd[b], x, acc[g][b]);
    }
  }
  add_head_block<HB, G>(acc, scale, w, s);
}

// out[g] for G keys; 16-bit keys are widened into kbuf [G, dI] first (once, not once per head block).
template <int G, typename T>
inline void score_keys_heads(const T* const* keys, const float* qT, const float* w, int64_t nIp, int64_t dI,
                             float scale, float* kbuf, float* out) {
  const float* kf[G];
  for (int g = 0; g < G; ++g) {
    if constexpr (std::is_same_v<T, float>) {
      kf[g] = keys[g];
    } else {
      to_float(keys[g], kbuf + g * dI, dI);
      kf[g] = kbuf + g * dI;
    }
  }
  float s[G] = {};
  const int64_t block = kHeadVectors * kLanes;
  int64_t h = 0;
  for (; h + block <= nIp; h += block) score_head_block<kHeadVectors, G>(kf, qT + h, nIp, dI, scale, w + h, s);
  for (; h < nIp; h += kLanes) score_head_block<1, G>(kf, qT + h, nIp, dI, scale, w + h, s);
  for (int g = 0; g < G; ++g) out[g] = s[g];
}

// score_pools for heads along the lanes (qT, w as above; kbuf [kKeysPerPass, dI]), with the same requests ahead.
template <typename T>
void score_pools_heads(const T* const* keys, int64_t n, const T* const* ahead, int64_t n_ahead, const float* qT,
                       const float* w, int64_t nIp, int64_t dI, float scale, float* kbuf, float* out) {
  int64_t i = 0;
  for (; i + kKeysPerPass <= n; i += kKeysPerPass) {
    for (int64_t j = i; j < std::min(i + kKeysPerPass, n_ahead); ++j) request_key(ahead[j], dI);
    score_keys_heads<kKeysPerPass>(keys + i, qT, w, nIp, dI, scale, kbuf, out + i);
  }
  for (; i < n; ++i) {
    if (i < n_ahead) request_key(ahead[i], dI);
    score_keys_heads<1>(keys + i, qT, w, nIp, dI, scale, kbuf, out + i);
  }
  for (int64_t j = n; j < n_ahead; ++j) request_key(ahead[j], dI);
}

// qT [T, dI, nIp] from q [T, nI, dI] (float32, contiguous), heads zero-padded to nIp. A plain loop: torch's
// transposing copy was slower on a cold call (its code is cold too).
at::Tensor transposed_queries(const at::Tensor& q, int64_t nIp) {
  const int64_t T = q.size(0), nI = q.size(1), dI = q.size(2);
  at::Tensor qT = at::empty({T, dI, nIp}, q.options());
  const float* src = q.data_ptr<float>();
  float* dst = qT.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t d = 0; d < dI; ++d) {
        float* row = dst + (t * dI + d) * nIp;
        for (int64_t h = 0; h < nI; ++h) row[h] = src[(t * nI + h) * dI + d];
        for (int64_t h = nI; h < nIp; ++h) row[h] = 0.0f;
      }
  });
  return qT;
}

// w [T, nIp] float32 from w [T, nI] (any float dtype and strides), zero-padded: a plain loop, as every step of
// indexer_select before its scoring. Each torch op there (a dtype conversion, a zero fill, a narrowed copy) cost
// 15-30 us on a call whose caches are cold, as a model step's call is: ~110 us together, nearly what scoring 8
// sequences of 4,096 tokens takes (benchmarks/README.md).
std::vector<float> padded_weights(const at::Tensor& w, int64_t nIp) {
  TORCH_CHECK(w.dim() == 2, "indexer_select: weights must be [T, heads]");
  const int64_t T = w.size(0), nI = w.size(1), s0 = w.stride(0), s1 = w.stride(1);
  std::vector<float> wp(T * nIp);
  float* dst = wp.data();
  GLM53_DISPATCH_FLOAT_TYPES(w.scalar_type(), "indexer_select weights", [&] {
    const scalar_t* src = w.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < nIp; ++h) dst[t * nIp + h] = h < nI ? static_cast<float>(src[t * s0 + h * s1]) : 0.0f;
  });
  return wp;
}

#if GLM53_AVX512
// Per token t, block b of 16 heads, channel pair p < dIp / 2: xq[((t * blocks + b) * dIp / 2 + p) * kLanes + lane] =
// head (16 b + lane)'s channels 2p, 2p + 1 from q [T, nI, dI] (bfloat16, channels contiguous; dIp >= dI, even),
// zero past the heads and channels: token_pairs_into's layout, the bfloat16 rows taken as they are (see
// padded_weights). The B operand of the tiles (score_pools_tiles) and of the pairs (score_pools_pairs).
std::vector<uint32_t> query_pairs(const at::Tensor& q, int64_t blocks, int64_t dIp) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.stride(2) == 1, "query_pairs: bfloat16 channels in a row");
  const int64_t T = q.size(0), nI = q.size(1), dI = q.size(2), per_token = blocks * dIp / 2 * kLanes;
  std::vector<uint32_t> xq(T * per_token);  // zeros
  const c10::BFloat16* src = q.data_ptr<c10::BFloat16>();
  for (int64_t t = 0; t < T; ++t)
    token_pairs_into([&](int64_t h) { return src + t * q.stride(0) + h * q.stride(1); }, nI, dI, dIp / 2,
                     [](int64_t p) { return p; }, xq.data() + t * per_token);
  return xq;
}

// The lines of the keys a pass of the pairs' loop (score_pools_pairs) scores next, requested one a step of the pass's
// loop over the channel pairs (line(i) at step i; rest(steps) after it), spread over the arithmetic. Requested in a
// burst before the pass (32 lines), they held the L1's few miss buffers and the loop waited on them: on Zen 5, 15 %
// of the loop's samples sat on the instruction after the requests, and spread they take a cold call 3-27 % down. The
// float32 lanes loop keeps its burst (spread there, a cold call took 1.3-1.6x longer: benchmarks/README.md). Lines
// past kMax (keys wider than the release's) are requested at once.
struct LineRequests {
  static constexpr int64_t kMax = 64;
  const char* at[kMax];
  int64_t n = 0;
  template <typename T>
  LineRequests(const T* const* keys, int64_t n_keys, int64_t dI) {
    const int64_t bytes = dI * static_cast<int64_t>(sizeof(T));
    for (int64_t k = 0; k < n_keys; ++k)
      for (int64_t b = 0; b < bytes; b += 64) {
        const char* line = reinterpret_cast<const char*>(keys[k]) + b;
        if (n < kMax) at[n++] = line;
        else __builtin_prefetch(line);
      }
  }
  void line(int64_t i) const {
    if (i < n) __builtin_prefetch(at[i]);
  }
  void rest(int64_t from) const {
    for (int64_t i = from; i < n; ++i) __builtin_prefetch(at[i]);
  }
};

// With bfloat16 queries and keys (a bfloat16 model's) on a CPU with bfloat16 dot products (AVX512_BF16: AMD from
// Zen 4, Intel from Cooper Lake) where the tiles do not run, the lanes loop multiplies channel pairs: one vdpbf16ps
// takes a vector of 16 heads' query pairs (query_pairs) and one key's channel pair broadcast, 32 products where
// score_head_block's FMA takes 16, and the keys are read as they lie instead of widened into kbuf first. With the
// release's 32 heads the float32 loop is bound by its multiply-adds (a pool's 4,096 of them, twice its key's read
// time at this VM's bandwidth: benchmarks/README.md). vdpbf16ps multiplies exactly and sums in float32 (the odd
// channel's product first, inputs and results below 2^-126 flushed to zero, as the tiles), so only the order of
// the sums differs from the float32 loop; a (pool, head) sum runs over the channel pairs in order.
template <int HB, int G>
[[gnu::always_inline]] GLM53_BF16_DOT inline void score_head_block_pairs(const c10::BFloat16* const* keys,
                                                                        const uint32_t* xq, int64_t block, int64_t P,
                                                                        float scale, const float* w, float* s,
                                                                        const LineRequests* req) {
  F16 acc[G][HB];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < HB; ++b) acc[g][b] = zero();
  for (int64_t p = 0; p < P; ++p) {
    if (req) req->line(p);
    __m512i qp[HB];
#pragma GCC unroll 4
    for (int b = 0; b < HB; ++b) qp[b] = _mm512_loadu_si512(xq + b * block + p * kLanes);
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      uint32_t pair;
      std::memcpy(&pair, keys[g] + 2 * p, sizeof(pair));
      const __m512i x = _mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
      for (int b = 0; b < HB; ++b) acc[g][b] = {dot_pairs(acc[g][b].v, qp[b], x)};
    }
  }
  if (req) req->rest(P);
  add_head_block<HB, G>(acc, scale, w, s);
}

// out[g] for G keys of 2P channels; xq one token's query pairs (blocks of 16 heads, P pairs each); ``req``: the
// next keys' lines, requested over the first block of heads (or null).
template <int G>
[[gnu::always_inline]] GLM53_BF16_DOT inline void score_keys_pairs(const c10::BFloat16* const* keys,
                                                                  const uint32_t* xq, const float* w, int64_t blocks,
                                                                  int64_t P, float scale, float* out,
                                                                  const LineRequests* req) {
  float s[G] = {};
  const int64_t block = P * kLanes;
  int64_t b = 0;
  for (; b + kHeadVectors <= blocks; b += kHeadVectors)
    score_head_block_pairs<kHeadVectors, G>(keys, xq + b * block, block, P, scale, w + b * kLanes, s,
                                            b == 0 ? req : nullptr);
  for (; b < blocks; ++b)
    score_head_block_pairs<1, G>(keys, xq + b * block, block, P, scale, w + b * kLanes, s, b == 0 ? req : nullptr);
  for (int g = 0; g < G; ++g) out[g] = s[g];
}

// score_pools_heads on the pairs (xq, w: one token's, heads padded to whole blocks), the next keys' lines requested
// over each pass (LineRequests).
[[gnu::noinline]] GLM53_BF16_DOT void score_pools_pairs(const c10::BFloat16* const* keys, int64_t n,
                                                        const c10::BFloat16* const* ahead, int64_t n_ahead,
                                                        const uint32_t* xq, const float* w, int64_t blocks, int64_t dI,
                                                        float scale, float* out) {
  const int64_t P = dI / 2;
  int64_t i = 0;
  for (; i + kKeysPerPass <= n; i += kKeysPerPass) {
    const LineRequests req(ahead + i, std::clamp<int64_t>(n_ahead - i, 0, kKeysPerPass), dI);
    score_keys_pairs<kKeysPerPass>(keys + i, xq, w, blocks, P, scale, out + i, &req);
  }
  for (; i < n; ++i) {
    if (i < n_ahead) request_key(ahead[i], dI);
    score_keys_pairs<1>(keys + i, xq, w, blocks, P, scale, out + i, nullptr);
  }
  for (int64_t j = n; j < n_ahead; ++j) request_key(ahead[j], dI);
}
#endif

#if GLM53_HAS_AMX
// With AMX tiles and bfloat16 queries and keys (a bfloat16 model's: float32 queries would first have to be rounded)
// the products of score_pools_heads run on the tiles (amx.h): A = 16 pools' keys (32 channels a product, read from
// the page where the 16 lie in one run, else copied into ``stage`` [16, dIp], whose padding columns stay zero),
// B = 16 heads' query channels in pairs (query_pairs), C = 16 pools x 16 heads in float32, two blocks of heads to
// each load of A; then the ReLU and weighting in vectors, summed over the blocks, and the 16 pools' horizontal sums
// together (sums_of_16). tdpbf16ps multiplies exactly and sums in float32 (inputs and results below 2^-126 flushed to
// zero), so only the order of the sums differs from the other paths. One product covers 16 x 16 x 32 (on the lanes
// the 32-head sums took ~280 cycles a pool at one vector FMA a cycle), so the keys' arrival bounds this loop: it asks
// for the next item's keys into the L2, spread over the loop (a burst of L1 requests at each group of 16 pools held
// every line fill buffer, and the loop waited on them: benchmarks/README.md).

// The sums of 16 vectors' lanes, sum[j] = reduce_add(v[j]) (the same tree, so the same result): halves of pairs of
// vectors, then quarters, then pairs of lanes, each level one add for twice the vectors of the level before, and a
// last permutation into order; ~3 instructions a vector where reduce_add takes ~8.
inline F16 sums_of_16(const F16* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes: v[2i] (0 + 2, 1 + 3), v[2i + 1] (0 + 2, 1 + 3)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0x44),
                         _mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane k: v[4i + k]'s four partial sums
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lane k: v[8i + k] (two partials), v[8i + 4 + k] (two)
    z[i] = _mm512_add_ps(_mm512_unpacklo_ps(y[2 * i], y[2 * i + 1]), _mm512_unpackhi_ps(y[2 * i], y[2 * i + 1]));
  const __m512 r = _mm512_add_ps(  // element 4k + m: the sum of v[4m + k]
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {_mm512_permutexvar_ps(order, r)};
}

GLM53_AMX void score_pools_tiles(const c10::BFloat16* const* keys, int64_t n, const c10::BFloat16* const* ahead,
                                 int64_t n_ahead, const uint32_t* xq, const float* w, int64_t blocks, int64_t dI,
                                 int64_t dIp, float scale, c10::BFloat16* stage, float* out) {
  alignas(64) float c[2][kLanes][kLanes];
  const F16 sc = set1(scale);
  const int64_t row_bytes = dIp * sizeof(c10::BFloat16), block = dIp / 2 * kLanes;
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - i0);
    const int64_t n_req = std::clamp<int64_t>(n_ahead - i0, 0, kLanes);
    const c10::BFloat16* rows = keys[i0];
    bool run = m == kLanes && dI == dIp;
    for (int64_t j = 1; run && j < kLanes; ++j) run = keys[i0 + j] == rows + j * dI;
    if (!run) {
      for (int64_t j = 0; j < m; ++j) std::memcpy(stage + j * dIp, keys[i0 + j], dI * sizeof(c10::BFloat16));
      rows = stage;
    }
    // v[j]: pool i0 + j's weighted ReLU terms, a lane per head of a block, summed over the blocks. Two blocks of
    // heads share each load of the keys; the next item's keys are requested one pool at a time meanwhile.
    F16 v[kLanes];
    for (int64_t b = 0; b < blocks; b += 2) {
      const uint32_t* x = xq + b * block;
      const bool two = b + 1 < blocks;
      if (two) amx_rows_by_two_pairs(rows, row_bytes, x, x + block, dIp, c[0], c[1]);
      else amx_rows_by_pairs(rows, nullptr, row_bytes, x, dIp, c[0], nullptr);
      const F16 w0 = load(w + b * kLanes), w1 = two ? load(w + (b + 1) * kLanes) : zero();
#pragma GCC unroll 16
      for (int64_t j = 0; j < kLanes; ++j) {
        if (b == 0 && j < n_req) request_key<1>(ahead[i0 + j], dI);
        F16 t = relu(load(c[0][j]) * sc) * w0;
        if (two) t = t + relu(load(c[1][j]) * sc) * w1;
        v[j] = b == 0 ? t : v[j] + t;
      }
    }
    store(out + i0, sums_of_16(v), static_cast<int>(m));
  }
  for (int64_t j = n; j < n_ahead; ++j) request_key<1>(ahead[j], dI);
}
#endif

inline int64_t index_width(int64_t topk, int64_t kp, bool tail) { return topk + (tail ? kp - 1 : 0); }

inline bool all_candidates_fit(int64_t max_position, int64_t topk, int64_t kp) {
  return (max_position + 1) / kp <= topk / kp;
}

// Every complete pool plus the tail if enabled: tokens 0..end-1, then -1.
void dense_row(int64_t pos, int64_t kp, bool tail, int64_t width, int64_t* out) {
  const int64_t end = tail ? pos + 1 : (pos + 1) / kp * kp;
  for (int64_t c = 0; c < width; ++c) out[c] = c < end ? c : -1;
}

// The chosen pools (the top-k entries that are candidates, ascending) expanded to their tokens, then the tail.
void expand_row(const int64_t* top, int64_t n_top, int64_t pos, int64_t kp, bool tail, int64_t width, int64_t* out) {
  const int64_t n_cand = (pos + 1) / kp;
  std::vector<int64_t> pools;
  pools.reserve(n_top);
  for (int64_t i = 0; i < n_top; ++i)
    if (top[i] < n_cand) pools.push_back(top[i]);
  std::sort(pools.begin(), pools.end());
  int64_t c = 0;
  for (int64_t p : pools)
    for (int64_t j = 0; j < kp; ++j) out[c++] = p * kp + j;
  if (tail)
    for (int64_t s = n_cand * kp; s <= pos; ++s) out[c++] = s;
  for (; c < width; ++c) out[c] = -1;
}

// The k <= P largest of a row's P scores as a set (any order), into top: false, writing nothing, where that set is
// not the same for every top-k, i.e. where the k-th largest score equals one left out, or where a score is NaN
// (which at::topk ranks above all) or infinite; the caller then asks at::topk. For a few of many (k * 64 <= P), a
// min-heap of the best k seen, so that a score not above its least costs one comparison; else a partition around
// the k-th (nth_element). Then the scores equal to the k-th are counted.
bool top_set(const float* row, int64_t P, int64_t k, int64_t* top) {
  if (k == 0) return true;
  F16 inf_or_nan = zero();  // 0 * each score: NaN where one is NaN or infinite
  for (int64_t j = 0; j < P; j += kLanes)
    inf_or_nan = fma(load(row + j, static_cast<int>(std::min<int64_t>(kLanes, P - j))), zero(), inf_or_nan);
  if (reduce_add(inf_or_nan) != 0.0f) return false;
  using Entry = std::pair<float, int64_t>;  // score, pool
  const auto above = [](const Entry& a, const Entry& b) { return a.first > b.first; };
  std::vector<Entry> best;
  if (k * 64 <= P) {
    best.resize(k);
    for (int64_t j = 0; j < k; ++j) best[j] = {row[j], j};
    std::make_heap(best.begin(), best.end(), above);  // the least on top
    for (int64_t j = k; j < P; ++j) {
      if (!(row[j] > best.front().first)) continue;
      std::pop_heap(best.begin(), best.end(), above);
      best.back() = {row[j], j};
      std::push_heap(best.begin(), best.end(), above);
    }
    std::swap(best.front(), best.back());  // the k-th largest last, as below
  } else {
    best.resize(P);
    for (int64_t j = 0; j < P; ++j) best[j] = {row[j], j};
    std::nth_element(best.begin(), best.begin() + (k - 1), best.end(), above);
  }
  const float cut = best[k - 1].first;
  int64_t equal = 0, kept = 0;
  for (int64_t j = 0; j < P; ++j) equal += row[j] == cut;
  for (int64_t i = 0; i < k; ++i) kept += best[i].first == cut;
  if (equal != kept) return false;
  for (int64_t i = 0; i < k; ++i) top[i] = best[i].second;
  return true;
}

// The top pools of each of n rows of P scores (``masked``, row-major), as the torch backend's at::topk call picks
// them (top_set, else that very call on the row), expanded into ``out`` [n, width].
void select_rows(float* masked, int64_t n, int64_t P, const int64_t* positions, int64_t topk, int64_t kp, bool tail,
                 int64_t width, int64_t* out) {
  const int64_t k = std::min(topk / kp, P);
  std::vector<int64_t> top(k);
  for (int64_t t = 0; t < n; ++t) {
    if (!top_set(masked + t * P, P, k, top.data())) {
      const at::Tensor row = at::from_blob(masked + t * P, {1, P}, at::kFloat);
      const at::Tensor idx = std::get<1>(at::topk(row, k, 1, /*largest=*/true, /*sorted=*/true)).contiguous();
      std::copy_n(idx.data_ptr<int64_t>(), k, top.data());
    }
    expand_row(top.data(), k, positions[t], kp, tail, width, out + t * width);
  }
}

at::Tensor float_contiguous(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

}  // namespace

// k, gate [T, dI] (rows may be strided, any float dtype), ape [kp, dI]; T a multiple of kp. Returns [T/kp, dI] f32.
at::Tensor kpool_compress(const at::Tensor& k_, const at::Tensor& gate_, const at::Tensor& ape_) {
  const int64_t kp = ape_.size(0), dI = ape_.size(1), T = k_.size(0);
  TORCH_CHECK_VALUE(T % kp == 0, "kpool_compress needs whole pools: ", T, " tokens, pool size ", kp);
  TORCH_CHECK(kp <= kMaxPool, "kpool_compress: pool size ", kp, " above ", kMaxPool);
  at::Tensor k = k_.stride(-1) == 1 ? k_ : k_.contiguous();
  at::Tensor gate = gate_.to(k.scalar_type());
  gate = gate.stride(-1) == 1 ? gate : gate.contiguous();
  at::Tensor ape = float_contiguous(ape_);
  at::Tensor out = at::empty({T / kp, dI}, k.options().dtype(at::kFloat));
  GLM53_DISPATCH_FLOAT_TYPES(k.scalar_type(), "kpool_compress", [&] {
    const scalar_t* kb = k.data_ptr<scalar_t>();
    const scalar_t* gb = gate.data_ptr<scalar_t>();
    at::parallel_for(0, T / kp, 16, [&](int64_t p0, int64_t p1) {
      const scalar_t* krow[kMaxPool];
      const scalar_t* grow[kMaxPool];
      for (int64_t p = p0; p < p1; ++p) {
        for (int64_t j = 0; j < kp; ++j) {
          krow[j] = kb + (p * kp + j) * k.stride(0);
          grow[j] = gb + (p * kp + j) * gate.stride(0);
        }
        compress_pool(krow, grow, ape.data_ptr<float>(), kp, dI, out.data_ptr<float>() + p * dI);
      }
    });
  });
  return out;
}

// q [Tq, nI, dI], weights [Tq, nI], pooled [P, dI] -> scores [Tq, P] float32 (no causality).
at::Tensor index_scores(const at::Tensor& q_, const at::Tensor& w_, const at::Tensor& pooled_) {
  at::Tensor q = float_contiguous(q_), w = float_contiguous(w_), pooled = float_contiguous(pooled_);
  const int64_t Tq = q.size(0), nI = q.size(1), dI = q.size(2), P = pooled.size(0);
  const float scale = static_cast<float>(std::pow(static_cast<double>(dI), -0.5));
  at::Tensor out = at::empty({Tq, P}, q.options());
  const float *qp = q.data_ptr<float>(), *wp = w.data_ptr<float>(), *kp = pooled.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, Tq * P, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / P, p = i % P;
      op[i] = pool_score(kp + p * dI, qp + t * nI * dI, wp + t * nI, nI, dI, scale);
    }
  });
  return out;
}

// Same contract as the torch select_tokens: [Tq, width] int64, rows ascending, -1 padded.
at::Tensor select_tokens(const std::optional<at::Tensor>& scores, const at::Tensor& positions_, int64_t topk,
                         int64_t kp, bool tail) {
  at::Tensor positions = positions_.to(at::kLong).contiguous();
  const int64_t Tq = positions.size(0), width = index_width(topk, kp, tail);
  at::Tensor out = at::empty({Tq, width}, positions.options());
  if (Tq == 0) return out;
  const int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t max_pos = *std::max_element(pos, pos + Tq);
  if (all_candidates_fit(max_pos, topk, kp)) {
    for (int64_t t = 0; t < Tq; ++t) dense_row(pos[t], kp, tail, width, op + t * width);
    return out;
  }
  TORCH_CHECK_VALUE(scores.has_value(),
              "select_tokens needs scores once a query has more than topk // kp candidate pools");
  at::Tensor masked = scores->to(at::kFloat).clone(at::MemoryFormat::Contiguous);
  const int64_t P = masked.size(1);
  TORCH_CHECK_VALUE((max_pos + 1) / kp <= P, "scores cover ", P, " pools but a query has ", (max_pos + 1) / kp,
              " complete pools");
  float* mp = masked.data_ptr<float>();
  for (int64_t t = 0; t < Tq; ++t)
    for (int64_t p = (pos[t] + 1) / kp; p < P; ++p) mp[t * P + p] = kLowest;
  select_rows(mp, Tq, P, pos, topk, kp, tail, width, op);
  return out;
}

// The step's tokens that complete a pool store the pool's compressed key. pooled [num_blocks, pools, dI] and raw
// [num_blocks, raw_pools, kp - 1, 2 dI] are the pages' regions (pools = block_size / kp; pool p of a page keeps its
// raw inputs in slot p % raw_pools), holding earlier steps' raw inputs; key_gate [T, 2 dI] the step's raw key and
// gate logits per token (cache dtype); slot_mapping [T] (-1: padding, not stored); ape [kp, dI]. A stored token
// whose slot is the last of a pool (slot % kp == kp - 1) completes it: K_p is computed (float32, as
// kpool_compress) from the pool's kp tokens' inputs and stored, in the cache dtype, as that pool's key. A pool
// token this step writes is the batch token d rows earlier whose slot is d lower (a page being written belongs to
// one request, whose tokens are consecutive and ascending in the batch); its inputs are the step's, the others'
// the page's. Pools are disjoint, so each work item writes what no other one reads.
void store_pooled_keys(at::Tensor& pooled, const at::Tensor& raw, const at::Tensor& key_gate_,
                       const at::Tensor& slot_mapping_, const at::Tensor& ape_) {
  at::Tensor ape = float_contiguous(ape_), slots = slot_mapping_.to(at::kLong).contiguous();
  TORCH_CHECK(pooled.dim() == 3 && pooled.stride(2) == 1 && raw.dim() == 4 && raw.stride(3) == 1,
              "store_pooled_keys: pooled must be [blocks, pools, dI] and raw [blocks, pools, kp - 1, 2 dI]");
  const int64_t kp = ape.size(0), dI = ape.size(1), n_blocks = pooled.size(0), pools = pooled.size(1);
  TORCH_CHECK(kp <= kMaxPool, "store_pooled_keys: pool size ", kp, " above ", kMaxPool);
  const int64_t raw_pools = raw.size(1);
  TORCH_CHECK(pooled.size(2) == dI && raw.size(2) == kp - 1 && raw.size(3) == 2 * dI && raw_pools >= 1,
              "store_pooled_keys: page regions do not match pools of ", kp, " keys of ", dI);
  TORCH_CHECK(raw.scalar_type() == pooled.scalar_type(), "store_pooled_keys: pooled and raw dtypes differ");
  at::Tensor key_gate = key_gate_.to(pooled.scalar_type());
  key_gate = key_gate.stride(-1) == 1 ? key_gate : key_gate.contiguous();
  TORCH_CHECK(key_gate.dim() == 2 && key_gate.size(1) == 2 * dI && key_gate.size(0) >= slots.size(0),
              "store_pooled_keys: key_gate must be [T, 2 dI] for every slot");
  const int64_t* sp = slots.data_ptr<int64_t>();

  std::vector<int64_t> items;  // batch tokens that complete a pool
  for (int64_t t = 0; t < slots.size(0); ++t)
    if (sp[t] >= 0 && sp[t] % kp == kp - 1) items.push_back(t);

  GLM53_DISPATCH_FLOAT_TYPES(pooled.scalar_type(), "store_pooled_keys", [&] {
    scalar_t* pbase = pooled.data_ptr<scalar_t>();
    const scalar_t* rbase = raw.data_ptr<scalar_t>();
    const scalar_t* kg = key_gate.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(items.size()), 16, [&](int64_t i0, int64_t i1) {
      std::vector<float> out(dI);
      const scalar_t* krow[kMaxPool];
      const scalar_t* grow[kMaxPool];
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = items[i], blk = sp[t] / (pools * kp), pool = sp[t] % (pools * kp) / kp;
        TORCH_CHECK(blk < n_blocks, "store_pooled_keys: slot ", sp[t], " outside the cache");
        for (int64_t j = 0; j < kp; ++j) {
          const int64_t d = kp - 1 - j;
          krow[j] = t >= d && sp[t - d] == sp[t] - d
                        ? kg + (t - d) * key_gate.stride(0)
                        : rbase + blk * raw.stride(0) + pool % raw_pools * raw.stride(1) + j * raw.stride(2);
        }
        for (int64_t j = 0; j < kp; ++j) grow[j] = krow[j] + dI;
        compress_pool(krow, grow, ape.data_ptr<float>(), kp, dI, out.data());
        from_float(out.data(), pbase + blk * pooled.stride(0) + pool * pooled.stride(1), dI);
      }
    });
  });
}

// The whole batch at once, reading the paged cache. pooled [num_blocks, pools, dI] holds the compressed key of
// every complete pool (store_pooled_keys), pool p of a request in slot p % pools of its block p / pools;
// block_table [num_reqs, max_blocks]; query_start_loc [num_reqs + 1]; seq_lens [num_reqs] (tokens including
// this step's). Request r's queries are its last q_len positions. q [T, nI, dI], weights [T, nI]. Returns [T,
// width] int64, positions within each request, rows ascending, -1 padded: equal to scoring each request with
// index_scores over transformers' row layout and calling select_tokens.
at::Tensor indexer_select(const at::Tensor& q_, const at::Tensor& w_, const at::Tensor& pooled,
                          const at::Tensor& block_table_, const at::Tensor& query_start_loc_,
                          const at::Tensor& seq_lens_, int64_t topk, int64_t kp, bool tail) {
  TORCH_CHECK(q_.dim() == 3, "indexer_select: q must be [T, heads, dI]");
  TORCH_CHECK(pooled.dim() == 3 && pooled.stride(2) == 1, "indexer_select: pooled must be [blocks, pools, dI]");
  const int64_t T = q_.size(0), nI = q_.size(1), dI = q_.size(2);
  TORCH_CHECK(pooled.size(2) == dI, "indexer_select: pooled keys of ", pooled.size(2), " values for queries of ",
              dI);
  TORCH_CHECK(block_table_.dim() == 2, "indexer_select: block_table must be [requests, blocks]");
  const IndexView block_table(block_table_, "indexer_select", "block_table");
  const std::vector<int64_t> sl = index_values(seq_lens_, "indexer_select", "seq_lens");
  const int64_t n_req = static_cast<int64_t>(sl.size()), pools = pooled.size(1), block_size = pools * kp,
                n_blocks = pooled.size(0), max_blocks = block_table_.size(1);
  // (the queries past the last request's are padding: the output's rows for them stay -1)
  const std::vector<int64_t> qsl = query_starts(query_start_loc_, n_req, T, false, block_table_, "indexer_select");
  const int64_t width = index_width(topk, kp, tail);
  const float scale = static_cast<float>(std::pow(static_cast<double>(dI), -0.5));
  const int64_t *qs = qsl.data(), *lens = sl.data();
  at::Tensor out = at::empty({T, width}, q_.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  std::fill_n(op, T * width, int64_t{-1});

  // Score buffers of the sparse requests, [q_len, ceil(seq_len / kp)] each, in one allocation; the work items
  // of phase 1 are (request, chunk of pools).
  std::vector<int64_t> buf_off(n_req + 1, 0);
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t r = 0; r < n_req; ++r) {
    const int64_t q_len = qs[r + 1] - qs[r], S = lens[r];
    TORCH_CHECK(q_len <= S, "indexer_select: request ", r, " has more queries than tokens");
    TORCH_CHECK((S + block_size - 1) / block_size <= max_blocks, "indexer_select: block table too short");
    int64_t cols = 0;
    if (q_len > 0 && !all_candidates_fit(S - 1, topk, kp)) {
      cols = (S + kp - 1) / kp;
      for (int64_t p0 = 0; p0 < S / kp; p0 += kPoolChunk) items.emplace_back(r, p0);
    }
    buf_off[r + 1] = buf_off[r] + q_len * cols;
  }
  std::vector<float> scores(buf_off[n_req], kLowest);
  const bool lanes = nI >= kLanes && !items.empty();  // heads along the lanes (score_pools_heads)
  const int64_t nIp = (nI + kLanes - 1) / kLanes * kLanes, dIp = (dI + 31) / 32 * 32;
#if GLM53_HAS_AMX
  const bool tiles = lanes && amx_tiles() && q_.scalar_type() == at::kBFloat16 &&
                     pooled.scalar_type() == at::kBFloat16 && dI % 2 == 0;  // score_pools_tiles
#else
  const bool tiles = false;
#endif
#if GLM53_AVX512
  const bool pairs = lanes && !tiles && has_bf16_dot() && q_.scalar_type() == at::kBFloat16 &&
                     pooled.scalar_type() == at::kBFloat16 && dI % 2 == 0;  // score_pools_pairs
#else
  const bool pairs = false;
#endif
  // The queries as each scoring form reads them: pairs for the tiles (channels padded to whole products) and the
  // dot products, else float32 (transposed for the lanes).
  at::Tensor q, w, qT;
  std::vector<float> wp;
  std::vector<uint32_t> xq;
  const bool f32_queries = !tiles && !pairs;
  const int64_t xq_dim = tiles ? dIp : dI;
  if (lanes) wp = padded_weights(w_, nIp);
#if GLM53_AVX512
  if (!f32_queries) xq = query_pairs(q_.stride(2) == 1 ? q_ : q_.contiguous(), nIp / kLanes, xq_dim);
#endif
  if (f32_queries) q = float_contiguous(q_);
  if (lanes && f32_queries) qT = transposed_queries(q, nIp);
  if (!lanes) w = float_contiguous(w_);

  GLM53_DISPATCH_FLOAT_TYPES(pooled.scalar_type(), "indexer_select", [&] {
    const scalar_t* base = pooled.data_ptr<scalar_t>();
    const int64_t block_stride = pooled.stride(0), pool_stride = pooled.stride(1);
    // Pool p's compressed key: slot p % pools of the pooled keys of the request's block p / pools.
    auto pooled_key = [&](int64_t r, int64_t p) {
      const int64_t blk = block_table(r, p / pools);
      TORCH_CHECK(blk >= 0 && blk < n_blocks, "indexer_select: block id ", blk, " outside the cache");
      return base + blk * block_stride + (p % pools) * pool_stride;
    };
    // Item i's keys into ``keys``; returns their count.
    auto chunk_keys = [&](int64_t i, const scalar_t** keys) {
      const auto [r, p0] = items[i];
      const int64_t p1 = std::min(p0 + kPoolChunk, lens[r] / kp);
      for (int64_t p = p0; p < p1;) {  // a block's pools in one run (one lookup and division per block)
        const scalar_t* key = pooled_key(r, p);
        for (const int64_t end = std::min(p1, (p / pools + 1) * pools); p < end; ++p, key += pool_stride)
          keys[p - p0] = key;
      }
      return p1 - p0;
    };
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
      const scalar_t* bufs[2][kPoolChunk];
      const scalar_t** keys = bufs[0];
      const scalar_t** next = bufs[1];
      std::vector<float> kbuf(lanes && f32_queries ? kKeysPerPass * dI : 0);
#if GLM53_HAS_AMX
      std::vector<c10::BFloat16> stage(tiles ? kLanes * dIp : 0, c10::BFloat16(0.0f));
      if (tiles) amx_configure();
#endif
      int64_t n_keys = i0 < i1 ? chunk_keys(i0, keys) : 0;
      for (int64_t i = i0; i < i1; ++i) {
        const auto [r, p0] = items[i];
        const int64_t S = lens[r], q0 = qs[r], q_len = qs[r + 1] - q0, cols = (S + kp - 1) / kp;
        // The next item's keys are requested while this one is scored (by its first query that scores it).
        const int64_t n_following = i + 1 < i1 ? chunk_keys(i + 1, next) : 0;
        int64_t n_ahead = n_following;
        float* sc = scores.data() + buf_off[r];
        for (int64_t t = 0; t < q_len; ++t) {
          const int64_t n_cand = (S - q_len + t + 1) / kp;  // pools complete at this query's position
          if (n_cand <= p0) continue;
          const int64_t n_score = std::min(n_keys, n_cand - p0);
          if (tiles) {
#if GLM53_HAS_AMX
            using B16 = const c10::BFloat16* const*;  // tiles: the keys are bfloat16 (scalar_t is, at run time)
            score_pools_tiles(reinterpret_cast<B16>(keys), n_score, reinterpret_cast<B16>(next), n_ahead,
                              xq.data() + (q0 + t) * nIp / 2 * xq_dim, wp.data() + (q0 + t) * nIp, nIp / kLanes,
                              dI, dIp, scale, stage.data(), sc + t * cols + p0);
#endif
          } else if (pairs) {
#if GLM53_AVX512
            using B16 = const c10::BFloat16* const*;  // pairs: the keys are bfloat16 (scalar_t is, at run time)
            score_pools_pairs(reinterpret_cast<B16>(keys), n_score, reinterpret_cast<B16>(next), n_ahead,
                              xq.data() + (q0 + t) * nIp / 2 * xq_dim, wp.data() + (q0 + t) * nIp, nIp / kLanes, dI,
                              scale, sc + t * cols + p0);
#endif
          } else if (lanes) {
            const float* qt = qT.data_ptr<float>() + (q0 + t) * dI * nIp;
            const float* wt = wp.data() + (q0 + t) * nIp;
            score_pools_heads(keys, n_score, next, n_ahead, qt, wt, nIp, dI, scale, kbuf.data(), sc + t * cols + p0);
          } else {
            const float* qt = q.data_ptr<float>() + (q0 + t) * nI * dI;
            const float* wt = w.data_ptr<float>() + (q0 + t) * nI;
            score_pools(keys, n_score, next, n_ahead, qt, wt, nI, dI, scale, sc + t * cols + p0);
          }
          n_ahead = 0;
        }
        for (int64_t j = 0; j < n_ahead; ++j) request_key(next[j], dI);
        std::swap(keys, next);
        n_keys = n_following;
      }
#if GLM53_HAS_AMX
      if (tiles) amx_release();
#endif
    });
  });

  at::parallel_for(0, n_req, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> pos;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t S = lens[r], q0 = qs[r], q_len = qs[r + 1] - q0;
      if (q_len == 0) continue;
      pos.resize(q_len);
      for (int64_t t = 0; t < q_len; ++t) pos[t] = S - q_len + t;
      if (buf_off[r + 1] == buf_off[r]) {
        for (int64_t t = 0; t < q_len; ++t) dense_row(pos[t], kp, tail, width, op + (q0 + t) * width);
        continue;
      }
      const int64_t cols = (S + kp - 1) / kp;
      select_rows(scores.data() + buf_off[r], q_len, cols, pos.data(), topk, kp, tail, width, op + q0 * width);
    }
  });
  return out;
}

}  // namespace glm53
