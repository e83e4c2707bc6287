// Weight rows dotted with a few token rows: the inner loops of the decode-sized matrix products (moe.cpp,
// linear.cpp), and the block-FP8 pieces they share.
//
// Rows go R at a time (1 or 2) against up to kTok tokens at a time (4 with AVX-512, 2 with 16 vector registers),
// so each loaded lane group of a weight row feeds kTok FMAs and R * kTok accumulators hide the FMA latency
// without spilling.
//
// Block FP8 (weight[n, k] = float(e4m3[n, k]) * scale[n / bn, k / bk]) is computed two ways:
//   direct  for a few tokens: the token rows are multiplied by one row block's scales (scale_by_blocks), then
//           dotted with the E4M3 rows as they stream in (vec.h's E4M3 load), so every weight byte is read once
//           and converted once (dot_rows); nothing is written but the results. avx2: the token rows in the order
//           32 bytes widened by shifts come out in (dot_quad_rows); one token unscaled, shared by a gate row and its
//           up row, each column block's sums times its scale, a task's rows a call (task_quads). bfloat16 tokens
//           on a CPU with bfloat16 dot products: the token rows as they are (in unpack order) against the E4M3
//           values as bfloat16, each column block's sums times its scale, a task's rows a call (dot_task_pairs).
//   tile    for more tokens: the tokens lie across the vector lanes and a few rows at a time, dequantized a chunk
//           of columns at a time into an L1-resident float32 buffer (dequantize_row), are broadcast against
//           them (rows_by_tokens, below), so the conversion is paid once per weight value and pass. bfloat16
//           tokens on a CPU with bfloat16 dot products: the rows' E4M3 values as bfloat16 against token pairs
//           instead (rows_by_token_pairs), twice the products per instruction.
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "common.h"

namespace glm53 {

// Tokens sharing each load of a weight row: 2 rows x kTok tokens of accumulators in registers (vec.h).
constexpr int kTok = kVectorRegs >= 32 ? 4 : 2;
constexpr int64_t kRowsPerTask = 16;        // weight rows per parallel task (a multiple of kLanes: see below)
constexpr int64_t kAheadBytes = 8 << 10;    // prefetch distance of a stream of consecutive rows (rows_ahead)
constexpr int64_t kChunkBytes = 128 << 10;  // float32 token rows a task works through per pass over its rows

// E4M3 rows read as value * kE4m3Unit (vec.h), so a direct-path token row is multiplied by its block scales
// divided by kE4m3Unit. Where that factor is large (avx2: 2^120) a token value times its scale of 2^8 or more
// would overflow float32, so the tokens take 2^64 of it and each finished dot product the rest (kE4m3SumScale).
// Both are powers of two, so every product and partial sum is the unit-2^-8 path's times 2^-56 and rounds as it
// does (products of a magnitude below 2^-70, which would turn subnormal, aside): the avx512 path's sums.
constexpr float kE4m3SumScale = kE4m3Unit < 0x1p-64f ? 1.0f / (kE4m3Unit * 0x1p64f) : 1.0f;
constexpr float kE4m3TokenScale = 1.0f / (kE4m3Unit * kE4m3SumScale);

// Tokens up to which products take the direct path. Each further group of kTok tokens reads the rows again
// (from L1: a row pair is a few KiB), against one float32 row write and re-read per row in the tile path; two
// groups is about where the two cost the same.
constexpr int64_t kDirectMaxTokens = 2 * kTok;

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows of ``row_bytes`` bytes that a stream of consecutive rows prefetches ahead of the one it reads (at least 1).
// A row pair of released size (FP8: 2 x 2-4 KiB) prefetched 4 KiB ahead read 19 GB/s on one Zen 5 core from
// memory, 8 KiB ahead 23-27 (C++ loop of dot_block; benchmarks/README.md).
inline int64_t rows_ahead(int64_t row_bytes) {
  return std::max<int64_t>(1, kAheadBytes / std::max<int64_t>(row_bytes, 1));
}

// Tokens per pass over a block of weight rows, so their ``len``-float rows stay in cache across the block.
inline int64_t token_chunk(int64_t len, int64_t bytes = kChunkBytes) {
  return std::max<int64_t>(kTok, bytes / (4 * std::max<int64_t>(len, 1)) / kTok * kTok);
}

// acc[r][j] = dot(rows[r], xs[j]) over len values for R rows and N tokens (float32 sums). ``ahead`` (or null):
// R rows to prefetch meanwhile, the ones the caller reads next. W: float, bfloat16, float16 or E4m3 (whose rows
// then read as value * kE4m3Unit: the caller scales the tokens, see scale_by_blocks, and the sums are multiplied
// by kE4m3SumScale here).
// kRowTokens: each row has tokens of its own, row r's token j at xs[j] + r * row_step (a gate row and its up row,
// each against the token times its own row block's scales: moe.cpp).
// E4M3 rows with fewer than 4 sums (a row pair against one token, one row against up to 3) keep each sum as two,
// over alternate lane groups, added at the end: with one, the chain of fused multiply-adds into it bound the loop
// (a row pair against one token ~8 weight bytes a cycle, 25-28 GB/s on one Zen 5 core from L2 or from memory;
// 32-33 from L2 with two). fp8_linear 12288 x 4096 at one token, caches flushed: 1.05-1.09x on one thread,
// 0.92-1.12x on two (six runs, median 1.03x: memory-bound there); FP8 experts 1.04x / 0.99-1.05x; avx2 within
// noise (its sums are two 8-lane chains already). 16-bit rows stream twice the bytes per product and keep one sum
// (linear16 0.95-1.00x with two).
// Never inlined: inside the kernels' large parallel bodies GCC kept an accumulator and the E4M3 mask on the
// stack (a store and two reloads per lane group); compiled on its own the loop keeps them in registers, about
// 1.25x faster on the E4M3 decode path (one call per row pair: the call itself is noise).
template <int R, int N, typename W, int A, bool kRowTokens = false>
[[gnu::noinline]] void dot_block(const W* const* rows, std::type_identity_t<const W*> const* ahead,
                                 const float* const* xs, int64_t len, float (*acc)[A], int64_t row_step = 0) {
  static_assert(N <= A);
  constexpr int C = std::is_same_v<W, E4m3> && R * N < 4 ? 2 : 1;  // sums a (row, token)
  F16 s[C][R][N];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < N; ++j) s[c][r][j] = zero();
  // columns [i, i + m) of every row against the tokens, into sums c
  const auto group = [&](int c, int64_t i, int m) __attribute__((always_inline)) {
    if (ahead != nullptr)
      for (int r = 0; r < R; ++r) __builtin_prefetch(ahead[r] + i);
    F16 w[R];
    for (int r = 0; r < R; ++r) w[r] = load(rows[r] + i, m);
    for (int j = 0; j < N; ++j) {
      if constexpr (kRowTokens) {
        for (int r = 0; r < R; ++r) s[c][r][j] = fma(w[r], load(xs[j] + r * row_step + i, m), s[c][r][j]);
      } else {
        const F16 xv = load(xs[j] + i, m);
        for (int r = 0; r < R; ++r) s[c][r][j] = fma(w[r], xv, s[c][r][j]);
      }
    }
  };
  if constexpr (GLM53_AVX512) {
    for (int64_t i0 = 0; i0 < len; i0 += C * kLanes) {
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) {
        const int64_t i = i0 + c * kLanes;
        if (C > 1 && i >= len) break;
        group(c, i, static_cast<int>(std::min<int64_t>(kLanes, len - i)));
      }
    }
  } else {
    // On avx2 and portable a load that may be partial branches to a masked or a copying form (neither has masked
    // byte loads): the whole lane groups run in a loop of their own, the rest after it (the same sums in the same
    // order). E4M3 rows from L2, one Zen 5 core, avx2: 1.45x the bytes a second for a row pair against one token,
    // 1.15x at two, 1.05-1.3x for one row against 3-6; portable 2-3x. With masked loads (avx512) this form measured
    // 0.6-0.9x for one row.
    int64_t i = 0;
    for (; i + C * kLanes <= len; i += C * kLanes)
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) group(c, i + c * kLanes, kLanes);
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c, i += kLanes)
      if (i < len) group(c, i, static_cast<int>(std::min<int64_t>(kLanes, len - i)));
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) {
      acc[r][j] = reduce_add(C > 1 ? s[0][r][j] + s[C - 1][r][j] : s[0][r][j]);
      if constexpr (std::is_same_v<W, E4m3>) acc[r][j] *= kE4m3SumScale;
    }
}

// One task's rows for the direct paths that take a task a call (task_quads, dot_task_rows, dot_task_pairs):
// ``sets`` (1 or 2) sets of ``rows`` <= kLanes E4M3 rows, set s's row i at base[s] + i * stride, each set's rows in
// one row block (scale[s]: its block scales). While reading its row i, a set prefetches its row min(i + ahead,
// limit - 1) (limit: the rows from base[s] on that exist).
struct TaskRows {
  const E4m3* base[2];
  const float* scale[2];
  int sets;
  int64_t stride, rows, ahead, limit;
  const E4m3* row(int s, int64_t i) const { return base[s] + i * stride; }
  const E4m3* ahead_of(int s, int64_t i) const { return row(s, std::min(i + ahead, limit - 1)); }  // to prefetch
};

#if GLM53_AVX2
// avx2, E4M3 rows, 32 bytes at a time: the bytes widen to four 8-float vectors with 16-bit shifts alone. An
// arithmetic shift right by 4 puts the top byte of each 16-bit half where float32 has its exponent and mantissa
// (with copies of the sign above, masked as in vec.h's e4m3_floats), a shift of the 32-bit lanes by 16 brings the
// low half's up, and the same after a 16-bit shift left by 8 gives the other two bytes: 5 shifts and 4 ANDs a 32
// bytes, against 8 shuffles and shifts and 4 ANDs for vec.h's E4M3 load, whose shuffle and shift units bound the
// direct path. Lane i of vector k holds column 4i + {3, 1, 2, 0}[k] of the group, so the tokens are laid out in
// that order ("quad order": quad_order, scale_by_blocks). Zen 3, a row pair, one core: 4.9-5.3 weights a cycle
// against one token from memory (3.5-4.1 with the shuffles); from the L2 or L3 4.4-4.7 against two (3.8-3.9),
// 3.4-3.6 against three (3.0-3.2), 2.8-3.1 against four (2.2-2.8), 2.0-2.25 against five (2.0-2.4; 1.7 in the
// same loop with both halves of both rows kept in registers, which spilled sums) (benchmarks/README.md).
constexpr int64_t kQuad = 32;  // columns a load widens
inline int64_t quad_len(int64_t len) { return ceil_div(len, kQuad) * kQuad; }
// Whether task_quads takes column blocks of bk columns (whole groups of kQuad).
inline bool quads_fit(int64_t bk) { return bk % kQuad == 0; }

// The two 16-bit-shifted forms of 32 E4M3 bytes v that quad_float masks: half 0 has bytes 3 and 1 at the tops of
// the 16-bit halves, half 1 bytes 2 and 0 (quad_halves: both).
[[gnu::always_inline]] inline __m256i quad_half(__m256i v, int hk) {
  return _mm256_srai_epi16(hk == 0 ? v : _mm256_slli_epi16(v, 8), 4);
}
[[gnu::always_inline]] inline void quad_halves(__m256i v, __m256i (&half)[2]) {
  half[0] = quad_half(v, 0);
  half[1] = quad_half(v, 1);
}
// Vector 2 hk + kk (kk 0, 1; constants after unrolling) of the group, from its half hk, as float32 bits times
// kE4m3Unit.
[[gnu::always_inline]] inline __m256 quad_float(__m256i half, int kk) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0x87F00000u));
  return _mm256_castsi256_ps(_mm256_and_si256(kk == 0 ? half : _mm256_slli_epi32(half, 16), mask));
}
// Vector k (0..3) of the group.
[[gnu::always_inline]] inline __m256 quad_floats(const __m256i (&half)[2], int k) {
  return quad_float(half[k / 2], k % 2);
}

// out[quad_len(len)]: x[i] times kE4m3TokenScale and, with a scale_row, times scale_row[i / bk] (bk a multiple of
// kQuad / 2), in quad order, zero past len. Each 32 columns go through the 4 x 4 transposes of two 128-bit lanes:
// loaded as (columns 4m .. 4m + 3 | 16 + 4m .. 16 + 4m + 3), m = 0..3, the transposed rows are the columns
// 4i + c of the group in lane i.
inline void quad_order(const float* x, int64_t len, float* out, const float* scale_row = nullptr, int64_t bk = 0) {
  for (int64_t g0 = 0; g0 < len; g0 += kQuad) {
    const float* xg = x + g0;
    alignas(32) float part[kQuad];
    if (g0 + kQuad > len) {  // the ragged end: copied into zeros
      std::fill(part, part + kQuad, 0.0f);
      std::memcpy(part, xg, sizeof(float) * (len - g0));
      xg = part;
    }
    const auto scale_at = [&](int64_t i) {
      return kE4m3TokenScale * (scale_row != nullptr ? scale_row[std::min(i, len - 1) / bk] : 1.0f);
    };
    const __m256 s = _mm256_setr_m128(_mm_set1_ps(scale_at(g0)), _mm_set1_ps(scale_at(g0 + kQuad / 2)));
    __m256 a[4];
    for (int m = 0; m < 4; ++m)
      a[m] = _mm256_mul_ps(_mm256_loadu2_m128(xg + kQuad / 2 + 4 * m, xg + 4 * m), s);
    const __m256 t0 = _mm256_unpacklo_ps(a[0], a[1]), t1 = _mm256_unpackhi_ps(a[0], a[1]);
    const __m256 t2 = _mm256_unpacklo_ps(a[2], a[3]), t3 = _mm256_unpackhi_ps(a[2], a[3]);
    // column offset c of each group of 4 to vector {3, 1, 2, 0}[c]
    _mm256_storeu_ps(out + g0 + 24, _mm256_shuffle_ps(t0, t2, 0x44));
    _mm256_storeu_ps(out + g0 + 8, _mm256_shuffle_ps(t0, t2, 0xEE));
    _mm256_storeu_ps(out + g0 + 16, _mm256_shuffle_ps(t1, t3, 0x44));
    _mm256_storeu_ps(out + g0, _mm256_shuffle_ps(t1, t3, 0xEE));
  }
}

// acc[r][j] = dot(rows[r], xs[j]) for a row pair of len E4M3 bytes against N tokens in quad order (quad_len(len)
// values, zero past len), both rows sharing each token load; kRowTokens: N = 1 and row r's token at
// xs[0] + r * row_step instead. A (row, token) sum takes C vectors (one chain of multiply-adds each): 8 chains at
// one and two tokens (fewer leave Zen 3's two FMA units waiting on the 4-cycle latency), and one a (row, token)
// from three (6-10 chains: 12 spill; three tokens measured faster with 6 than with 12). With 5 tokens the 10 sums
// leave no room for both halves of both rows (GCC spilled sums): each half is made from a load of its own of the
// bytes, from the L1 (Zen 3, a row pair from the L2, one core: 2.0-2.25 weights a cycle against 1.7; the same
// form at 4 tokens 1.02x, within the spread, so up to 4 tokens the halves stay in registers). ``ahead`` as in
// dot_block.
// quad_rows_sums: sum[r][j], the lanes' partial sums (reduce_add8 gives the dot product, times kE4m3SumScale);
// dot_quad_rows: the dot products.
template <int N, bool kRowTokens = false>
[[gnu::always_inline]] inline void quad_rows_sums(const E4m3* const* rows, const E4m3* const* ahead,
                                                  const float* const* xs, int64_t len, __m256 (&sum)[2][N],
                                                  int64_t row_step = 0) {
  static_assert(!kRowTokens || N == 1);
  constexpr int C = N == 1 ? 4 : N == 2 ? 2 : 1;
  __m256 s[C][2][N];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < 2; ++r)
      for (int j = 0; j < N; ++j) s[c][r][j] = _mm256_setzero_ps();
  // vector k of both rows (w) against the tokens' columns i + 8k ..
  const auto products = [&](const __m256 (&w)[2], int64_t i, int k) __attribute__((always_inline)) {
    for (int j = 0; j < N; ++j) {
      if constexpr (kRowTokens) {
        for (int r = 0; r < 2; ++r)
          s[k % C][r][j] = _mm256_fmadd_ps(w[r], _mm256_loadu_ps(xs[j] + r * row_step + i + 8 * k), s[k % C][r][j]);
      } else {
        __m256 x = _mm256_loadu_ps(xs[j] + i + 8 * k);
        asm("" : "+x"(x));  // one load for both rows (GCC would fold it into each fused multiply-add)
        for (int r = 0; r < 2; ++r) s[k % C][r][j] = _mm256_fmadd_ps(w[r], x, s[k % C][r][j]);
      }
    }
  };
  // the 32 bytes at src[r] of each row against the tokens' columns [i, i + 32)
  const auto group = [&](const uint8_t* const* src, int64_t i) __attribute__((always_inline)) {
    const auto bytes = [&](int r) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[r])); };
    if constexpr (N < 5) {
      __m256i half[2][2];
      for (int r = 0; r < 2; ++r) quad_halves(bytes(r), half[r]);
      for (int k = 0; k < 4; ++k) products({quad_floats(half[0], k), quad_floats(half[1], k)}, i, k);
    } else {
      for (int hk = 0; hk < 2; ++hk) {
        const __m256i half[2] = {quad_half(bytes(0), hk), quad_half(bytes(1), hk)};
        for (int kk = 0; kk < 2; ++kk) products({quad_float(half[0], kk), quad_float(half[1], kk)}, i, 2 * hk + kk);
      }
    }
  };
  int64_t i = 0;
  for (; i + kQuad <= len; i += kQuad) {
    if (ahead != nullptr)
      for (int r = 0; r < 2; ++r) __builtin_prefetch(ahead[r] + i);
    const uint8_t* src[2] = {reinterpret_cast<const uint8_t*>(rows[0] + i),
                             reinterpret_cast<const uint8_t*>(rows[1] + i)};
    group(src, i);
  }
  if (i < len) {  // the rows' ragged end: copied into zeros
    alignas(32) uint8_t tail[2][kQuad] = {};
    for (int r = 0; r < 2; ++r) std::memcpy(tail[r], rows[r] + i, len - i);
    const uint8_t* src[2] = {tail[0], tail[1]};
    group(src, i);
  }
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < N; ++j) {
      sum[r][j] = s[0][r][j];
      for (int c = 1; c < C; ++c) sum[r][j] = _mm256_add_ps(sum[r][j], s[c][r][j]);
    }
}
template <int N, int A, bool kRowTokens = false>
[[gnu::noinline]] void dot_quad_rows(const E4m3* const* rows, const E4m3* const* ahead, const float* const* xs,
                                     int64_t len, float (*acc)[A], int64_t row_step = 0) {
  static_assert(N <= A);
  __m256 sum[2][N];
  quad_rows_sums<N, kRowTokens>(rows, ahead, xs, len, sum, row_step);
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < N; ++j) acc[r][j] = reduce_add8(sum[r][j]) * kE4m3SumScale;
}

// total[r] = sum over column blocks kb of scale_rows[r][kb] * (the lanes' partial sums of rows[r] times x over the
// block; reduce_add8 gives the dot product), for 2 rows of len E4M3 bytes (block_k a multiple of kQuad: quads_fit)
// and one token xq in quad order, unscaled (quad_order without a scale row): a gate row and its up row share the
// token, the scales go on the column blocks' sums. A standalone loop on Zen 3, a row pair against one token from
// memory: 4.9-5.3 weights a cycle against 3.5-4.1 for dot_block with a scaled token row per row. ``ahead`` as in
// dot_block.
[[gnu::always_inline]] inline void quads_sums(const E4m3* const* rows, const E4m3* const* ahead, const float* xq,
                                              const float* const* scale_rows, int64_t len, int64_t bk,
                                              __m256 (&total)[2]) {
  total[0] = total[1] = _mm256_setzero_ps();
  // the 32 bytes v[r] of each row against the token's 32 values at x, into the block's sums p[r][0..1]
  const auto group = [&](const __m256i* v, const float* x, __m256 (*p)[2]) __attribute__((always_inline)) {
    __m256i half[2][2];
    for (int r = 0; r < 2; ++r) quad_halves(v[r], half[r]);
    for (int k = 0; k < 4; ++k) {
      __m256 xv = _mm256_loadu_ps(x + 8 * k);
      asm("" : "+x"(xv));  // one load for both rows (GCC would fold it into each fused multiply-add)
      for (int r = 0; r < 2; ++r) p[r][k % 2] = _mm256_fmadd_ps(quad_floats(half[r], k), xv, p[r][k % 2]);
    }
  };
  for (int64_t b0 = 0, kb = 0; b0 < len; b0 += bk, ++kb) {
    const int64_t b1 = std::min(b0 + bk, len);
    __m256 p[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    int64_t i = b0;
    for (; i + kQuad <= b1; i += kQuad) {
      for (int r = 0; r < 2; ++r) __builtin_prefetch(ahead[r] + i);
      const __m256i v[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[0] + i)),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[1] + i))};
      group(v, xq + i, p);
    }
    if (i < b1) {  // the rows' ragged end (only in the last block): copied into zeros
      alignas(32) uint8_t tail[2][kQuad] = {};
      for (int r = 0; r < 2; ++r) std::memcpy(tail[r], rows[r] + i, b1 - i);
      const __m256i v[2] = {_mm256_load_si256(reinterpret_cast<const __m256i*>(tail[0])),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(tail[1]))};
      group(v, xq + i, p);
    }
    for (int r = 0; r < 2; ++r)
      total[r] = _mm256_fmadd_ps(_mm256_add_ps(p[r][0], p[r][1]), _mm256_set1_ps(scale_rows[r][kb]), total[r]);
  }
}

// out[i] = reduce_add8(sums[i]) * kE4m3SumScale for a task's rows i < rows, 0 for the later lanes (their sums are
// zeroed first), 8 rows at a time (reduce_add8x8)
inline void store_row_sums(__m256 (&sums)[kLanes], int64_t rows, float* out) {
  for (int64_t i = rows; i < kLanes; ++i) sums[i] = _mm256_setzero_ps();
  const __m256 unit = _mm256_set1_ps(kE4m3SumScale);
  _mm256_storeu_ps(out, _mm256_mul_ps(reduce_add8x8(sums), unit));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(reduce_add8x8(sums + 8), unit));
}

// out[s][0][i] = the dot product of set s's row i (for i < t.rows; 0 in the later lanes) with one token xq in quad
// order, unscaled, each column block's sums times its scale (quads_sums): the task's rows two at a time (a row of
// each set, or consecutive rows of one). The whole task in one call, its sums reduced 8 rows at a time
// (reduce_add8x8): with a call per row pair and scalar reductions, ~40 % of the time went outside the loop over
// the columns on rows of 256-512 columns (perf, one Zen 5 core as an AVX2 CPU: one token over 64 experts of hidden
// 512).
[[gnu::noinline]] inline void task_quads(const TaskRows& t, const float* xq, int64_t len, int64_t bk,
                                         float (*const* out)[kLanes]) {
  __m256 sums[2][kLanes];
  const auto pair = [&](const int (&set)[2], const int64_t (&row)[2]) __attribute__((always_inline)) {
    const E4m3* rows[2];
    const E4m3* ahead[2];
    const float* scales[2];
    for (int r = 0; r < 2; ++r) {
      rows[r] = t.row(set[r], row[r]);
      ahead[r] = t.ahead_of(set[r], row[r]);
      scales[r] = t.scale[set[r]];
    }
    __m256 total[2];
    quads_sums(rows, ahead, xq, scales, len, bk, total);
    for (int r = 0; r < 2; ++r) sums[set[r]][row[r]] = total[r];
  };
  if (t.sets == 2) {
    for (int64_t i = 0; i < t.rows; ++i) pair({0, 1}, {i, i});
  } else {
    int64_t i = 0;
    for (; i + 1 < t.rows; i += 2) pair({0, 0}, {i, i + 1});
    if (i < t.rows) pair({0, 0}, {i, i});  // an odd last row: both halves of the pair
  }
  for (int s = 0; s < t.sets; ++s) store_row_sums(sums[s], t.rows, out[s][0]);
}
#endif

// The same for 1..N tokens (n picks the instantiation).
template <int R, int N = kTok, typename W, int A>
inline void dot_tokens(const W* const* rows, std::type_identity_t<const W*> const* ahead, const float* const* xs, int n,
                       int64_t len, float (*acc)[A]) {
  if constexpr (N > 1)
    if (n < N) return dot_tokens<R, N - 1>(rows, ahead, xs, n, len, acc);
  dot_block<R, N>(rows, ahead, xs, len, acc);
}

// Tokens up to which block-FP8 products take the direct path. avx2: 28, in passes of at most kQuadTokens
// (dot_task_rows). The tile path costs the same for any count up to a token group's 16 (its lanes past the tokens
// multiply zeros) and again for 17-32, the direct path grows with the tokens. AMD Zen 3, released sizes
// (fp8_linear 12288 x 4096, 4 experts with as many tokens each), caches flushed, 2 threads, the tile path's time /
// the direct path's: 2.0x at 8 tokens, 1.7x at 10, 1.2-1.5x at 12, 1.1-1.3x at 13-15, 1.1x at 16, 1.65-1.74x at
// 17, 1.2-1.6x at 20-24 (vec.h's E4M3 load, before the quad-order kernels); with dot_quad_rows (bench_kernel_ab.py,
// a build taking the direct path to 32 against one stopping at 24, two runs, linear / experts) 1.17-1.35x /
// 1.15-1.31x at 25, 1.26x / 1.07x at 26, 1.05-1.12x / 1.02x at 28, 1.10x / 1.00x at 30, 0.87-0.90x / 0.90x at 32
// (benchmarks/README.md). 29-31 are left to the tile path: the direct path's margin there is within the spread.
constexpr int64_t kE4m3DirectMaxTokens = GLM53_AVX2 ? 28 : kDirectMaxTokens;

#if GLM53_AVX2
// Tokens dot_quad_rows takes at a time (dot_task_rows): at most 5, a row pair's 10 sums (6 would take 12 of the 16
// registers; at 5 the rows' bytes are loaded once for each half).
constexpr int kQuadTokens = 5;
#endif

// Token rows as the direct path reads them against E4M3 rows: len values (avx2: quad_len(len), in quad order).
inline int64_t direct_len(int64_t len) {
#if GLM53_AVX2
  return quad_len(len);
#else
  return len;
#endif
}

// out[direct_len(len)]: x[i] * scale_row[i / bk] * kE4m3TokenScale, i < len, laid out as the direct path reads it
// (avx2: quad order, zero past len): a token row times one row block's scales, for the direct path's dot with
// E4M3 rows read as value * kE4m3Unit.
inline void scale_by_blocks(const float* x, const float* scale_row, int64_t len, int64_t bk, float* out) {
#if GLM53_AVX2
  quad_order(x, len, out, scale_row, bk);
#else
  for (int64_t b0 = 0, kb = 0; b0 < len; b0 += bk, ++kb) {
    const F16 s = set1(scale_row[kb] * kE4m3TokenScale);
    const int64_t b1 = std::min(b0 + bk, len);
    for (int64_t i = b0; i < b1; i += kLanes) {
      const int m = static_cast<int>(std::min<int64_t>(kLanes, b1 - i));
      store(out + i, load(x + i, m) * s, m);
    }
  }
#endif
}

// 1 or 2 rows (``nr``) against ``n`` tokens, kTok at a time; acc[r][j] for j < n (n <= kDirectMaxTokens,
// kE4m3DirectMaxTokens for E4M3 rows, whose tokens are scale_by_blocks rows). ``ahead`` is prefetched during the
// first group only (the later groups find the rows in cache). E4M3 rows with more than kTok tokens go one row at a
// time against all of them (one accumulator per token): each weight is converted once instead of once per kTok
// tokens, for twice the token loads. fp8_linear and FP8 experts at released sizes, caches flushed, 2 threads:
// portable 1.15-1.35x faster at 3-4 tokens, avx512 1.1-1.3x at 5-8 (benchmarks/README.md; on bfloat16 pairs,
// dot_task_pairs below, two rows at a time measured faster on Zen 5). The sums are the same either way (every
// accumulator adds the same products in the same order). avx2 reads E4M3 rows against tokens in quad order
// instead (dot_task_rows).
template <typename W, int A>
inline void dot_rows(const W* const* rows, std::type_identity_t<const W*> const* ahead, int nr,
                     const float* const* xs, int n, int64_t len, float (*acc)[A]) {
  static_assert(!(GLM53_AVX2 && std::is_same_v<W, E4m3>), "avx2 reads E4M3 rows with dot_task_rows");
  if constexpr (std::is_same_v<W, E4m3>) {
    if (n > kTok) {
      for (int r = 0; r < nr; ++r)
        dot_tokens<1, kE4m3DirectMaxTokens>(rows + r, ahead != nullptr ? ahead + r : nullptr, xs, n, len, acc + r);
      return;
    }
  }
  float part[2][kTok];
  for (int j0 = 0; j0 < n; j0 += kTok) {
    const int g = std::min(kTok, n - j0);
    const W* const* pf = j0 == 0 ? ahead : nullptr;
    if (nr == 2) dot_tokens<2>(rows, pf, xs + j0, g, len, part);
    else dot_tokens<1>(rows, pf, xs + j0, g, len, part);
    for (int r = 0; r < nr; ++r)
      for (int j = 0; j < g; ++j) acc[r][j0 + j] = part[r][j];
  }
}

// A row pair of len E4M3 bytes, row r against its own scale_by_blocks token row at x + r * row_step:
// acc[r][0] (an expert's gate row and its up row, each with its row block's scales).
template <int A>
inline void dot_row_tokens(const E4m3* const* rows, const E4m3* const* ahead, const float* x, int64_t row_step,
                           int64_t len, float (*acc)[A]) {
  const float* xs[1] = {x};
#if GLM53_AVX2
  dot_quad_rows<1, A, true>(rows, ahead, xs, len, acc, row_step);
#else
  dot_block<2, 1, E4m3, A, true>(rows, ahead, xs, len, acc, row_step);
#endif
}

// A task's E4M3 rows (TaskRows, its scales unused) against n <= kE4m3DirectMaxTokens token rows per set, xs[s][j]:
// scale_by_blocks rows of set s's row block. out[s][j][i] = dot(set s's row i, xs[s][j]) for i < t.rows (0 in the
// later lanes): two rows of a set at a time, the sets in turn. avx2: the row pair against up to kQuadTokens tokens
// a pass in quad order, passes of 4 tokens, the most products a weight and cycle (Zen 3, dot_quad_rows), then 3
// (6: 3 + 3, 10: 3 + 3 + 4), a 5 rather than a pass of 1 (9: 5 + 4); the later passes find the rows in cache. Its
// sums wait as vectors and are reduced 8 rows at a time (reduce_add8x8), as in task_quads. Elsewhere dot_rows.
#if GLM53_AVX2
template <int G>
[[gnu::always_inline]] inline void quad_pass(const E4m3* const* rows, const E4m3* const* ahead, const float* const* xs,
                                             int64_t len, int64_t i, __m256 (*sums)[kLanes]) {
  __m256 part[2][G];
  quad_rows_sums<G>(rows, ahead, xs, len, part);
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < G; ++j) sums[j][i + r] = part[r][j];
}
[[gnu::noinline]] inline void dot_task_rows(const TaskRows& t, const float* const* const* xs, int n, int64_t len,
                                            float (*const* out)[kLanes]) {
  static_assert(kQuadTokens == 5, "the passes below");
  __m256 sums[2][kE4m3DirectMaxTokens][kLanes];
  for (int64_t i = 0; i < t.rows; i += 2) {
    const int64_t i1 = std::min(i + 1, t.rows - 1);  // an odd last row: both halves of the pair
    for (int s = 0; s < t.sets; ++s) {
      const E4m3* rows[2] = {t.row(s, i), t.row(s, i1)};
      const E4m3* ahead[2] = {t.ahead_of(s, i), t.ahead_of(s, i1)};
      for (int j0 = 0; j0 < n;) {
        const int left = n - j0, rest = left % 4;
        const int g = rest == 0 ? 4 : rest == 3 || (rest == 2 && left >= 6) ? 3 : rest == 2 ? 2 : left >= 5 ? 5 : 1;
        const E4m3* const* pf = j0 == 0 ? ahead : nullptr;
        switch (g) {
          case 1: quad_pass<1>(rows, pf, xs[s] + j0, len, i, sums[s] + j0); break;
          case 2: quad_pass<2>(rows, pf, xs[s] + j0, len, i, sums[s] + j0); break;
          case 3: quad_pass<3>(rows, pf, xs[s] + j0, len, i, sums[s] + j0); break;
          case 4: quad_pass<4>(rows, pf, xs[s] + j0, len, i, sums[s] + j0); break;
          default: quad_pass<5>(rows, pf, xs[s] + j0, len, i, sums[s] + j0); break;
        }
        j0 += g;
      }
    }
  }
  for (int s = 0; s < t.sets; ++s)
    for (int j = 0; j < n; ++j) store_row_sums(sums[s][j], t.rows, out[s][j]);
}
#else
inline void dot_task_rows(const TaskRows& t, const float* const* const* xs, int n, int64_t len,
                          float (*const* out)[kLanes]) {
  float acc[2][kE4m3DirectMaxTokens];
  for (int64_t i = 0; i < t.rows; i += 2) {
    const int nr = static_cast<int>(std::min<int64_t>(2, t.rows - i));
    for (int s = 0; s < t.sets; ++s) {
      const E4m3* rows[2] = {t.row(s, i), t.row(s, i + nr - 1)};
      const E4m3* ahead[2] = {t.ahead_of(s, i), t.ahead_of(s, i + nr - 1)};
      dot_rows(rows, ahead, nr, xs[s], n, len, acc);
      for (int j = 0; j < n; ++j)
        for (int r = 0; r < nr; ++r) out[s][j][i + r] = acc[r][j];
    }
  }
  for (int s = 0; s < t.sets; ++s)
    for (int j = 0; j < n; ++j) std::fill(out[s][j] + t.rows, out[s][j] + kLanes, 0.0f);
}
#endif

// ---- tokens across the lanes (linear.cpp's tile path) ------------------------------------------------------
// The dot products above put a weight row's values across the lanes: every kTok tokens load the row again and
// every (row, token) pair ends in a horizontal sum, so with more tokens than the direct path takes they are bound
// by loads (~45 GFLOP/s on two AVX2 cores). Here the tokens lie across the lanes instead (x transposed once per
// call, kLanes tokens per group) and kRowTile weight rows, widened to float32 a chunk of columns at a time, are
// broadcast one value at a time: each column is one vector load and kRowTile FMAs into accumulators that hold
// out[row, tokens] themselves (~85 GFLOP/s from cache on the same cores). Every output sums the products of a
// chunk of columns in order, then adds that to the previous chunks' total (a float32 error like the dot products'
// 16 partial sums; one running sum over K = 4,096 columns was ~10x theirs).
constexpr int kRowTile = std::min<int>(kRowsPerTask, kVectorRegs - 2);  // accumulators + the tokens + a broadcast
constexpr int64_t kColumnChunk = 256;  // columns widened per step: kRowTile rows of them stay in L1
// Tokens from which moe.cpp's experts put them across the lanes. With fewer, most lanes of the one token group
// would multiply zeros: there each row, dequantized into L1, is dotted with kTok tokens at a time (dot_tokens).
// One FP8 expert of GLM-5.3-Flash's size, AVX2 (Zen 5), 2 threads, two runs: one token group across the lanes
// 7.0-7.2 ms (9 and 12 tokens; the same for any count up to 16), the dot products 5.8-6.0 (5 tokens), 6.6-7.0 (6),
// 7.4-7.8 (7), 8.3-8.5 (8). The avx2 build's FP8 experts have since taken the direct path up to 28 tokens
// (kE4m3DirectMaxTokens), which starts the tile path for them at 29.
constexpr int64_t kAcrossLanesMinTokens = 7;
// Token groups per pass over a block of rows (moe.cpp, which may give one expert a whole prefill's tokens): each
// row tile reads the pass's token groups once, 4 MiB at K = 4,096 for 16 groups (256 tokens, where linear.cpp's
// tile path ends), which stays in the last-level cache; each pass widens the rows again (one conversion per
// weight value and 256 tokens).
constexpr int64_t kTilePassGroups = 16;

// xt [ceil(M / kLanes)][K][kLanes]: token j's value k (row(j)[k]) at xt[(j / kLanes) * K * kLanes + k * kLanes +
// j % kLanes], zero in the lanes past the last token.
template <typename RowOf>
void tokens_across_lanes(const RowOf& row, int64_t M, int64_t K, float* xt) {
  if (M % kLanes != 0) std::fill_n(xt + (M / kLanes) * K * kLanes, K * kLanes, 0.0f);
  for (int64_t j = 0; j < M; ++j) {
    const float* src = row(j);
    float* dst = xt + (j / kLanes) * K * kLanes + j % kLanes;
    for (int64_t k = 0; k < K; ++k) dst[k * kLanes] = src[k];
  }
}

// acc[r][lane] = (acc[r][lane] if ``accumulate``) + sum_k rows[r * ld + k] * xt[k * kLanes + lane], k < len, for R
// widened rows (the sum over k from zero, then added). ``ahead`` (or null): R byte ranges of ``ahead_bytes`` each,
// the weight the caller widens next, prefetched evenly over the loop.
template <int R>
[[gnu::noinline]] void rows_by_tokens(const float* rows, int64_t ld, const float* xt, int64_t len, bool accumulate,
                                      const char* const* ahead, int64_t ahead_bytes, float (*acc)[kLanes]) {
  F16 s[R];
#pragma GCC unroll 16  // a plain loop became a memset of the array (rep stos, once per call) before the unrolling
  for (int r = 0; r < R; ++r) s[r] = zero();
  const int64_t lines = ahead != nullptr ? ceil_div(ahead_bytes, 64) : 0;
  for (int64_t k0 = 0; k0 < len; k0 += kLanes) {
    for (int64_t l = k0 * lines / len; l < std::min(k0 + kLanes, len) * lines / len; ++l)
      for (int r = 0; r < R; ++r) __builtin_prefetch(ahead[r] + 64 * l);
    for (int64_t k = k0; k < std::min(k0 + kLanes, len); ++k) {
      const F16 xv = load(xt + k * kLanes);
      for (int r = 0; r < R; ++r) s[r] = fma(set1(rows[r * ld + k]), xv, s[r]);
    }
  }
  for (int r = 0; r < R; ++r) store(acc[r], accumulate ? load(acc[r]) + s[r] : s[r]);
}

// The same for 1..R rows (nr picks the instantiation).
template <int R = kRowTile>
inline void rows_by_tokens_n(int nr, const float* rows, int64_t ld, const float* xt, int64_t len, bool accumulate,
                             const char* const* ahead, int64_t ahead_bytes, float (*acc)[kLanes]) {
  if constexpr (R > 1)
    if (nr < R) return rows_by_tokens_n<R - 1>(nr, rows, ld, xt, len, accumulate, ahead, ahead_bytes, acc);
  rows_by_tokens<R>(rows, ld, xt, len, accumulate, ahead, ahead_bytes, acc);
}

// Token rows as the direct path on bfloat16 pairs reads them (dot_task_pairs, below): bfloat16, each column block
// of bk columns padded with zeros to a multiple of 64 (``block`` values), and within each 64 columns the order in
// which vec.h's unpacked_half yields a weight's values: columns 0-7, 16-23, 32-39, 48-55, then 8-15, 24-31,
// 40-47, 56-63. A row is ``len`` values; the padding's weights read as zero.
constexpr int64_t unpack_block(int64_t bk) { return ceil_div(bk, 64) * 64; }  // a column block, padded
struct UnpackOrder {
  int64_t K, bk, block, len;
  constexpr UnpackOrder(int64_t K_, int64_t bk_)
      : K(K_), bk(bk_), block(unpack_block(bk_)), len(ceil_div(K_, bk_) * block) {}
  bool padded() const { return len != K; }
  // fn(k, where column k lies) for every column k < K, in order (no division by bk: callers run it per call)
  template <typename Fn>
  void each(const Fn& fn) const {
    for (int64_t b0 = 0, o = 0; b0 < K; b0 += bk, o += block)
      for (int64_t q = 0, n = std::min(bk, K - b0); q < n; ++q)
        fn(b0 + q, o + (q & ~int64_t{63}) + (q & 8) * 4 + (q >> 4 & 3) * 8 + (q & 7));
  }
  // each()'s positions as a table, at[k] for every column k < K (for callers that place many rows)
  std::vector<int64_t> positions() const {
    std::vector<int64_t> at(K);
    each([&](int64_t k, int64_t a) { at[k] = a; });
    return at;
  }
  // row x (K values) into out (len values; the padding, if any, already zero)
  template <typename T>
  void put(const T* x, c10::BFloat16* out) const {
    each([&](int64_t k, int64_t at) { out[at] = c10::BFloat16(static_cast<float>(x[k])); });
  }
};

#if GLM53_AVX512
// ---- bfloat16 pairs (CPUs with AVX512_BF16) ----------------------------------------------------------------
// Block-FP8 rows and bfloat16 tokens (a bfloat16 model's products) on vec.h's dot_pairs: every E4M3 value is a
// bfloat16 value, so the rows are read as bfloat16 exactly (value * 2^-8, unscaled) and multiplied with the tokens
// (bfloat16 already) two columns at a time, two exact products per lane and instruction, twice the float32 FMA's.
// Each column block's sums are multiplied by the block's scale as they are added to the previous blocks' (the
// rows lie in one row block), so the weights are the exact ones, as on the float32 paths. The direct path
// (dot_task_pairs) streams the rows against the token rows (in unpack order, UnpackOrder above); the tile path
// (rows_by_token_pairs) widens a column block of kRowTile rows into L1 and broadcasts its pairs against the tokens
// laid across the lanes in pairs of columns, both in unpack order too.

// Token rows as pairs of bfloat16 columns across the lanes, P pairs a token group: token (g * kLanes + lane)'s
// columns 2p (low half) and 2p + 1 at xp[(g * P + pair_at(p)) * kLanes + lane], p < K / 2. row(j): token j's K
// values, float32 rows rounded to nearest even (exact for bfloat16 tokens), in vectors first (a scalar rounding per
// value was a tenth of an AMX call's time), bfloat16 rows taken as they are. Writes nothing else: the callers zero
// what stays empty.
template <typename RowOf, typename PairAt>
void token_pairs_into(const RowOf& row, int64_t M, int64_t K, int64_t P, const PairAt& pair_at, uint32_t* xp) {
  constexpr bool kRounded = std::is_same_v<decltype(row(0)), const float*>;
  std::vector<c10::BFloat16> b(kRounded ? K : 0);
  for (int64_t j = 0; j < M; ++j) {
    const c10::BFloat16* values;
    if constexpr (kRounded) {
      from_float(row(j), b.data(), K);
      values = b.data();
    } else {
      values = row(j);
    }
    uint32_t* dst = xp + (j / kLanes) * P * kLanes + j % kLanes;
    for (int64_t p = 0; p < K / 2; ++p) std::memcpy(dst + pair_at(p) * kLanes, values + 2 * p, 4);
  }
}

// xp[(g * order.len / 2 + p) * kLanes + lane]: token (g * kLanes + lane)'s values at positions 2p (low half) and
// 2p + 1 of its row in unpack order (UnpackOrder keeps columns 2c and 2c + 1 side by side, 2c first) as bfloat16,
// zero in the padding and past the last token. K even; at: order.positions().
template <typename RowOf>
void token_pairs_across_lanes(const RowOf& row, int64_t M, const UnpackOrder& order, const int64_t* at,
                              uint32_t* xp) {
  const int64_t P = order.len / 2, groups = ceil_div(M, kLanes);
  if (order.padded()) std::fill_n(xp, groups * P * kLanes, 0u);
  else if (M % kLanes != 0) std::fill_n(xp + (groups - 1) * P * kLanes, P * kLanes, 0u);
  token_pairs_into(row, M, order.K, P, [&](int64_t p) { return at[2 * p] / 2; }, xp);
}

// The same in column order (xp[(g * K / 2 + p) * kLanes + lane]: columns 2p and 2p + 1), zero past the last token:
// the B tiles of AMX's bfloat16 products (amx.h) for rows as they lie. K even.
template <typename RowOf>
void token_pairs_in_order(const RowOf& row, int64_t M, int64_t K, uint32_t* xp) {
  const int64_t P = K / 2, groups = ceil_div(M, kLanes);
  if (M % kLanes != 0) std::fill_n(xp + (groups - 1) * P * kLanes, P * kLanes, 0u);
  token_pairs_into(row, M, K, P, [](int64_t p) { return p; }, xp);
}

// E4M3 bytes w[0, n) as the bfloat16 values of value * 2^-8 (exact) in unpack order (vec.h's unpacked_half), 64
// columns at a time: ceil(n / 64) * 64 values, zero past n. The tile path's widening; from L1, one Zen 5 core, 16
// rows of 128 columns: 42-44 GB/s of E4M3 against 32-35 for byte lookups in column order, whose three shuffles
// (vpermb, two vpermi2b, AVX512_VBMI) per 32 values the unpacking does with one.
GLM53_BF16_DOT inline void e4m3_unpacked(const E4m3* w, int64_t n, c10::BFloat16* out) {
  for (int64_t i = 0; i < n; i += 64) {
    const __m512i b = load_e4m3_64(w + i, static_cast<int>(std::min<int64_t>(64, n - i)));
    if (__builtin_expect(e4m3_all_normal(b), 1)) {
      const __m512i lo = unpacked_half<false, true>(b), hi = unpacked_half<true, true>(b);  // (SIMDe's intrinsics
      _mm512_storeu_si512(out + i, lo);                                                     // are macros: no commas)
      _mm512_storeu_si512(out + i + 32, hi);
    } else {
      _mm512_storeu_si512(out + i, unpacked_half<false>(b));
      _mm512_storeu_si512(out + i + 32, unpacked_half<true>(b));
    }
  }
}

// Whether the direct path on bfloat16 pairs prefetches the rows it reads next into the L2 (prefetcht2) rather than
// the L1: on Intel CPUs. On the Sapphire Rapids-class VM (2 threads, caches flushed) the loop streamed 21-22 GB/s
// of E4M3 with L1 prefetches, no more than with none at all (each L1 prefetch holds one of the core's few line fill
// buffers until memory answers), and 25-27 with L2 prefetches, where the same loads without the arithmetic read
// 29; the FP8 FFN step at batch 1 ran 1.04-1.09x faster (benchmarks/README.md). AMD CPUs keep the L1 prefetches
// their measurements were made with (Zen 4 documents T1 / T2 into its L2, but none was at hand to measure).
inline bool ahead_to_l2() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

// The direct path on bfloat16 pairs: acc[r][j] = sum over the column blocks b of (block_scales[r * scale_step + b] *
// 2^8) * (sum over b's columns of rows[r] (E4M3 as bfloat16 values * 2^-8) * xs[j]) for R rows and N bfloat16
// token rows in unpack order (UnpackOrder, with bk): no scaled copy of the tokens, each weight converted once for
// all N tokens (unpacked_half) and multiplied in pairs. Each block's sums are kept apart (t) and added to the
// total scaled (s); below 4 sums the low and the high halves of the 64-column groups have sums of their own (one
// chain of dot products per sum bound the loop, as in dot_block). ``ahead`` as in dot_block. A 64-column group's
// low halves are converted and multiplied before its high halves: with both converted at once (four registers for
// a row pair) the accumulators spilled from 6 tokens (0.88-0.92x the byte lookups' time at 6 and 12 tokens).
template <bool kNormal, int R, int N, int C>
[[gnu::always_inline]] GLM53_BF16_DOT inline void pairs_products(const __m512i (&b)[R], const c10::BFloat16* const* xs,
                                                                  int64_t o, __m512 (&t)[C][R][N]) {
  __m512i w[R];
  for (int r = 0; r < R; ++r) w[r] = unpacked_half<false, kNormal>(b[r]);
  for (int j = 0; j < N; ++j) {
    const __m512i xv = _mm512_loadu_si512(xs[j] + o);
    for (int r = 0; r < R; ++r) t[0][r][j] = dot_pairs(t[0][r][j], w[r], xv);
  }
  for (int r = 0; r < R; ++r) w[r] = unpacked_half<true, kNormal>(b[r]);
  for (int j = 0; j < N; ++j) {
    const __m512i xv = _mm512_loadu_si512(xs[j] + o + 32);
    for (int r = 0; r < R; ++r) t[C - 1][r][j] = dot_pairs(t[C - 1][r][j], w[r], xv);
  }
}

template <int R, int N, int C, bool kAheadToL2>
[[gnu::always_inline]] GLM53_BF16_DOT inline void pairs_group(const E4m3* const* rows, const E4m3* const* ahead,
                                                               const c10::BFloat16* const* xs, int64_t i, int64_t o,
                                                               int m, __m512 (&t)[C][R][N]) {
  if (ahead != nullptr)
    for (int r = 0; r < R; ++r) __builtin_prefetch(ahead[r] + i, 0, kAheadToL2 ? 1 : 3);  // prefetcht2 / t0
  __m512i b[R];
  for (int r = 0; r < R; ++r) b[r] = load_e4m3_64(rows[r] + i, m);
  bool normal = true;  // one test of the bytes for every half (e4m3_all_normal)
  for (int r = 0; r < R; ++r) normal = normal && e4m3_all_normal(b[r]);
  if (__builtin_expect(normal, 1)) pairs_products<true>(b, xs, o, t);
  else pairs_products<false>(b, xs, o, t);
}

// s[r][j]: the lanes' partial sums (reduce_add gives the dot product) of R rows against N tokens over ``len``
// columns, rows[r]'s column block b scaled by scales[r][b] * 2^8.
template <int R, int N, bool kAheadToL2>
[[gnu::always_inline]] GLM53_BF16_DOT inline void block_pairs_sums(const E4m3* const* rows, const E4m3* const* ahead,
                                                                    const c10::BFloat16* const* xs,
                                                                    const float* const* scales, int64_t len,
                                                                    int64_t bk, __m512 (&s)[R][N]) {
  constexpr int C = R * N < 4 ? 2 : 1;
  const int64_t block = unpack_block(bk);
  __m512 t[C][R][N];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) s[r][j] = _mm512_setzero_ps();
  for (int64_t b0 = 0, kb = 0; b0 < len; b0 += bk, ++kb) {
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < N; ++j) t[c][r][j] = _mm512_setzero_ps();
    const int64_t b1 = std::min(b0 + bk, len);
    int64_t i = b0, o = kb * block;
    for (; i + 64 <= b1; i += 64, o += 64) pairs_group<R, N, C, kAheadToL2>(rows, ahead, xs, i, o, 64, t);
    if (i < b1) pairs_group<R, N, C, kAheadToL2>(rows, ahead, xs, i, o, static_cast<int>(b1 - i), t);
    for (int r = 0; r < R; ++r) {
      const __m512 sc = _mm512_set1_ps(scales[r][kb] * 0x1p8f);
      for (int j = 0; j < N; ++j)
        s[r][j] = _mm512_fmadd_ps(C > 1 ? _mm512_add_ps(t[0][r][j], t[1][r][j]) : t[0][r][j], sc, s[r][j]);
    }
  }
}

// Rows row[r] of sets set[r] against the task's tokens: N1 of them, then (N2 > 0) N2 more in a second pass that
// finds the rows in L1; their sums' lanes into sums[set][token][row].
template <int R, int N1, int N2, bool kAheadToL2>
[[gnu::always_inline]] GLM53_BF16_DOT inline void task_rows_sums(const TaskRows& t, const int (&set)[R],
                                                                  const int64_t (&row)[R],
                                                                  const c10::BFloat16* const* xs, int64_t len,
                                                                  int64_t bk, F16 (&sums)[2][N1 + N2][kLanes]) {
  const E4m3* rows[R];
  const E4m3* ahead[R];
  const float* scales[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = t.row(set[r], row[r]);
    ahead[r] = t.ahead_of(set[r], row[r]);
    scales[r] = t.scale[set[r]];
  }
  __m512 s1[R][N1];
  block_pairs_sums<R, N1, kAheadToL2>(rows, ahead, xs, scales, len, bk, s1);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N1; ++j) sums[set[r]][j][row[r]] = {s1[r][j]};
  if constexpr (N2 > 0) {
    __m512 s2[R][N2];
    block_pairs_sums<R, N2, kAheadToL2>(rows, nullptr, xs + N1, scales, len, bk, s2);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < N2; ++j) sums[set[r]][N1 + j][row[r]] = {s2[r][j]};
  }
}

// out[s][j][i] = the dot product of set s's row i with token j (for i < t.rows; 0 in the later lanes) for
// N1 + N2 bfloat16 token rows xs in unpack order, two rows at a time (a row of each set, or consecutive rows of
// one: each token load serves both; Zen 5, one core, from cache, 1.4-1.6x the weight bytes per second of one row
// at a time at 5-8 tokens, 6: 21 against 13 GB/s, 8: 16 against 10, although from 7 tokens a pass's 4 N
// accumulators no longer fit the registers), in one pass over the tokens (N2 = 0) or two (task_pairs_n; see
// task_rows_sums). The whole task in one call, its sums reduced 16 rows at a time (reduce_add16): with a call per
// row pair and scalar reductions, 40-55 % of the time went outside the loop over the columns on rows of 256-512
// columns (perf, one Zen 5 core: 16 tokens over 64 experts of hidden 512, 1-3 tokens an expert).
template <int N1, int N2, bool kAheadToL2>
[[gnu::noinline]] GLM53_BF16_DOT void task_pairs(const TaskRows& t, const c10::BFloat16* const* xs, int64_t len,
                                                 int64_t bk, float (*const* out)[kLanes]) {
  constexpr int N = N1 + N2;
  F16 sums[2][N][kLanes];
  if (t.sets == 2) {
    for (int64_t i = 0; i < t.rows; ++i) task_rows_sums<2, N1, N2, kAheadToL2>(t, {0, 1}, {i, i}, xs, len, bk, sums);
  } else {
    int64_t i = 0;
    for (; i + 1 < t.rows; i += 2) task_rows_sums<2, N1, N2, kAheadToL2>(t, {0, 0}, {i, i + 1}, xs, len, bk, sums);
    if (i < t.rows) task_rows_sums<1, N1, N2, kAheadToL2>(t, {0}, {i}, xs, len, bk, sums);
  }
  for (int s = 0; s < t.sets; ++s)
    for (int j = 0; j < N; ++j) {
      for (int64_t i = t.rows; i < kLanes; ++i) sums[s][j][i] = zero();
      store(out[s][j], reduce_add16(sums[s][j]));
    }
}

// acc[r] = (acc[r] if ``accumulate``) + scale * sum_k rows[r * ld + k] * token k, for R bfloat16 rows against token
// pairs xp over ``len`` columns (even); ``ahead`` as in rows_by_tokens. LD > 0: ld is LD, known when compiled.
template <int R, int64_t LD = 0>
[[gnu::noinline]] GLM53_BF16_DOT void rows_by_token_pairs(const c10::BFloat16* rows, int64_t ld_, const uint32_t* xp,
                                                          int64_t len, float scale, bool accumulate,
                                                          const char* const* ahead, int64_t ahead_bytes,
                                                          float (*acc)[kLanes]) {
  const int64_t ld = LD > 0 ? LD : ld_;
  __m512 s[R];
#pragma GCC unroll 16  // as in rows_by_tokens
  for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
  const int64_t lines = ahead != nullptr ? ceil_div(ahead_bytes, 64) : 0;
  for (int64_t k0 = 0; k0 < len; k0 += 2 * kLanes) {
    for (int64_t l = k0 * lines / len; l < std::min(k0 + 2 * kLanes, len) * lines / len; ++l)
      for (int r = 0; r < R; ++r) __builtin_prefetch(ahead[r] + 64 * l);
    for (int64_t k = k0; k < std::min(k0 + 2 * kLanes, len); k += 2) {
      const __m512i xv = _mm512_loadu_si512(xp + k / 2 * kLanes);
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, rows + r * ld + k, sizeof(pair));
        s[r] = dot_pairs(s[r], _mm512_set1_epi32(static_cast<int>(pair)), xv);
      }
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(acc[r], accumulate ? _mm512_fmadd_ps(s[r], sv, _mm512_loadu_ps(acc[r])) : _mm512_mul_ps(s[r], sv));
}

template <int R = kRowTile>
inline void rows_by_token_pairs_n(int nr, const c10::BFloat16* rows, int64_t ld, const uint32_t* xp, int64_t len,
                                  float scale, bool accumulate, const char* const* ahead, int64_t ahead_bytes,
                                  float (*acc)[kLanes]) {
  if constexpr (R > 1)
    if (nr < R)
      return rows_by_token_pairs_n<R - 1>(nr, rows, ld, xp, len, scale, accumulate, ahead, ahead_bytes, acc);
  // A full tile of 128-column blocks (the released checkpoints'): with the stride known, the rows' pairs are
  // offsets from one pointer instead of R pointers (more than the general-purpose registers: some were reloaded
  // from the stack every column pair), 3-7% faster per token group (Zen 5).
  if constexpr (R == kRowTile)
    if (ld == 128) return rows_by_token_pairs<R, 128>(rows, ld, xp, len, scale, accumulate, ahead, ahead_bytes, acc);
  rows_by_token_pairs<R>(rows, ld, xp, len, scale, accumulate, ahead, ahead_bytes, acc);
}
#endif

// Tokens up to which block-FP8 products on the bfloat16 pairs take the direct path (dot_task_pairs) rather than the
// tile path, which costs the same for any count up to a token group's kLanes. Zen 5, released sizes, caches
// flushed, 2 threads, bfloat16 tokens, time on the tile path / direct: fp8_linear 12288 x 4096 1.37 / 1.19-1.31 /
// 1.09-1.14 / 0.90 / 0.83 at 9 / 10 / 12 / 14 / 16 tokens; four experts with as many tokens each 1.39 / 1.15-1.37 /
// 1.08-1.21 / 0.85 / 0.89.
constexpr int64_t kPairsDirectMaxTokens = GLM53_AVX512 ? 12 : kE4m3DirectMaxTokens;

#if GLM53_AVX512
// task_pairs for n <= kPairsDirectMaxTokens tokens xs (out: as there): one pass up to kDirectMaxTokens, else two of
// n / 2 and the rest.
template <bool kAheadToL2, int N = kPairsDirectMaxTokens>
inline void task_pairs_n(const TaskRows& t, const c10::BFloat16* const* xs, int n, int64_t len, int64_t bk,
                         float (*const* out)[kLanes]) {
  if constexpr (N > 1)
    if (n < N) return task_pairs_n<kAheadToL2, N - 1>(t, xs, n, len, bk, out);
  static_assert(N <= 2 * kDirectMaxTokens);
  constexpr int n1 = N <= kDirectMaxTokens ? N : N / 2;
  task_pairs<n1, N - n1, kAheadToL2>(t, xs, len, bk, out);
}
inline void dot_task_pairs(const TaskRows& t, const c10::BFloat16* const* xs, int n, int64_t len, int64_t bk,
                           float (*const* out)[kLanes]) {
  if (ahead_to_l2()) task_pairs_n<true>(t, xs, n, len, bk, out);
  else task_pairs_n<false>(t, xs, n, len, bk, out);
}
#endif

// With AMX tiles (amx.h) the tile path costs about the same for any count up to a group's 16, so the direct path
// keeps only the counts where it reads the rows as fast. fp8_linear 4096 x 4096 from the L3, one core
// of the Intel Xeon, tile path on AMX / direct path: 1.01 / 0.99 / 0.88 / 0.78 / 0.57 / 0.30 at 1 / 2 / 3 / 4 / 8 / 16
// tokens. Shorter rows weigh the tile path's fixed costs (the tile configuration, the token layout, the row tile's
// setup) more: caches flushed, 2 threads, AMX's time / the direct path's at 3 / 4 / 6 tokens: fp8_linear 2048 x 512
// 1.18 / 1.02 / 0.95, 2048 x 2048 1.10 / 1.08 / 0.88; 8 FP8 experts of hidden 512 (intermediate 256) 1.33 / 1.11 /
// 1.05 (8 tokens: 0.87), of the released size 0.93 / 0.89 / 0.72. ``amx``: amx_tiles(), read once by the caller;
// K: the row length (for experts, the hidden size: step 1's rows, two thirds of an expert's bytes).
constexpr int64_t kAmxDirectMaxTokens = 2;           // rows of kAmxLongRow columns or more
constexpr int64_t kAmxShortRowDirectMaxTokens = 5;   // shorter rows
constexpr int64_t kAmxLongRow = 4096;
inline int64_t pairs_direct_max(bool amx, int64_t K) {
  if (!amx) return kPairsDirectMaxTokens;
  return K >= kAmxLongRow ? kAmxDirectMaxTokens : kAmxShortRowDirectMaxTokens;
}

// Whether block-FP8 products take the bfloat16 pairs above (direct path and tiles) for tokens of dtype ``tokens``
// and K columns: an avx512 build on a CPU with bfloat16 dot products, bfloat16 tokens (exact as bfloat16), K even.
inline bool bf16_pairs(at::ScalarType tokens, int64_t K) {
#if GLM53_AVX512
  return tokens == at::kBFloat16 && K % 2 == 0 && has_bf16_dot();
#else
  (void)tokens, (void)K;
  return false;
#endif
}

// out[l * ld + i] = acc[i][l] for nr rows and the first n lanes (tokens) of a row tile's sums, in out's dtype: the
// tile path's results, transposed back to token rows. Each token's column is gathered, then stored as a vector
// (rounded as vec.h's store rounds; a scalar rounding per value took a tenth of an AMX tile call's time).
template <typename T>
inline void store_tile_columns(const float (*acc)[kLanes], int nr, int64_t n, T* out, int64_t ld) {
  alignas(64) float column[kLanes] = {};
  for (int64_t l = 0; l < n; ++l) {
    for (int i = 0; i < nr; ++i) column[i] = acc[i][l];
    store(out + l * ld, load(column, nr), nr);
  }
}

// Values a tile row holds per chunk of ``chunk`` columns, and a token row of a token group holds for K columns, as
// row_tile_by_tokens reads them: chunk and K for float32 tiles; bfloat16 tiles (chunk = the column block) lay
// both out in unpack order, each column block padded to a multiple of 64 (UnpackOrder).
template <typename Tile>
constexpr int64_t tile_stride(int64_t chunk) {
  return std::is_same_v<Tile, float> ? chunk : unpack_block(chunk);
}
// A row tile's buffer: n zeroed values on a 64-byte boundary (AMX tile loads of rows that straddle two cache lines
// ran 1.3x slower).
template <typename T>
class TileBuffer {
 public:
  explicit TileBuffer(size_t n) : p_(static_cast<T*>(::operator new[](n * sizeof(T), std::align_val_t(64)))) {
    std::fill_n(p_.get(), n, T());
  }
  T* data() const { return p_.get(); }

 private:
  struct Free {
    void operator()(T* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };
  std::unique_ptr<T, Free> p_;
};

// Column blocks a row tile's buffer holds: bfloat16 tiles two (the AMX form widens the next block while the tiles
// multiply the current one).
template <typename Tile>
constexpr int64_t kTileBlocks = std::is_same_v<Tile, float> ? 1 : 2;
template <typename Tile>
constexpr int64_t tile_token_len(int64_t K, int64_t chunk) {
  return std::is_same_v<Tile, float> ? K : UnpackOrder(K, chunk).len;
}

#if GLM53_HAS_AMX
// row_tile_by_tokens' bfloat16 form on AMX tiles (amx.h), ``tile`` holding two column blocks of kRowTile rows.
// A column block's products go to the tiles 32 positions at a time, and between them the rows' next block is
// widened into the other half of the buffer, a few rows each time, so a core that can convert while its tiles
// multiply may. On the Intel Xeon VM measured it did not overlap them; what bounds the path there is the tile loads
// waiting on rows just stored and the E4M3 reads, not the conversion (amx.h). Then the block's sums are scaled
// into acc. Consecutive blocks use different C tiles, consecutive products different A and B tiles (amx.h). No
// lambdas here: they would not take the function's target, and the tile helpers would be calls.

// What a row tile's AMX pass works on (row_tile_by_token_pairs_amx's arguments, and derived sizes).
template <typename Widen>
struct AmxRowTile {
  int nr, nn;
  const Widen& widen;
  const char* const* rows;
  const char* const* next;
  int64_t elem;
  const uint32_t* xt;
  const float* block_scales;
  int64_t groups, K, chunk, stride, len;
  float* acc;
};

// Rows [i0, i1) of the column block at k0 into buf, prefetching what is widened after it (the next rows' first
// block after the last).
template <typename Widen>
GLM53_AMX inline void amx_widen_rows(const AmxRowTile<Widen>& t, int64_t k0, int i0, int i1, c10::BFloat16* buf) {
  const int64_t k1 = k0 + t.chunk, ahead = std::min(t.chunk, k1 < t.K ? t.K - k1 : t.K) * t.elem;
  for (int i = i0; i < i1; ++i) {
    t.widen(i, k0, std::min(t.chunk, t.K - k0), buf + i * t.stride);
    const char* p = k1 < t.K ? t.rows[i] + k1 * t.elem : i < t.nn ? t.next[i] : nullptr;
    if (p != nullptr)
      for (int64_t l = 0; l < ahead; l += 64) __builtin_prefetch(p + l);
  }
}

// Column block kb (at k0, widened in cur) against every token group on C tile C, widening the next block into nxt
// (if any) during the first group's products.
template <int C, typename Widen>
GLM53_AMX inline void amx_column_block(const AmxRowTile<Widen>& t, int64_t k0, int64_t kb, const c10::BFloat16* cur,
                                       c10::BFloat16* nxt) {
  const int64_t steps = ceil_div(std::min(t.chunk, t.K - k0), 64) * 2;  // 32 positions each, an even count
  const int64_t row_bytes = t.stride * static_cast<int64_t>(sizeof(c10::BFloat16));
  const bool more = k0 + t.chunk < t.K;
  const int per_pair = static_cast<int>(ceil_div(t.nr, steps / 2));  // rows widened per pair of products
  const __m512 sv = _mm512_set1_ps(t.block_scales[kb] * 0x1p8f);
  alignas(64) float c[kLanes][kLanes];
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint32_t* xg = t.xt + (g * t.len + kb * t.stride) / 2 * kLanes;
    amx_zero<C>();
    for (int64_t s = 0; s < steps; s += 2) {
      amx_product<C, 0>(cur + 32 * s, row_bytes, xg + 16 * s * kLanes);
      amx_product<C, 1>(cur + 32 * (s + 1), row_bytes, xg + 16 * (s + 1) * kLanes);
      if (g == 0 && more) {
        const int i0 = static_cast<int>(s / 2) * per_pair;
        amx_widen_rows(t, k0 + t.chunk, std::min(i0, t.nr), std::min(i0 + per_pair, t.nr), nxt);
      }
    }
    amx_store<C>(c);
    auto* ag = reinterpret_cast<float(*)[kLanes]>(t.acc + g * kRowTile * kLanes);
    for (int r = 0; r < t.nr; ++r) {
      const __m512 v = _mm512_load_ps(c[r]);
      _mm512_storeu_ps(ag[r], k0 > 0 ? _mm512_fmadd_ps(v, sv, _mm512_loadu_ps(ag[r])) : _mm512_mul_ps(v, sv));
    }
  }
}

template <typename Widen>
GLM53_AMX void row_tile_by_token_pairs_amx(int nr, const Widen& widen, const char* const* rows,
                                           const char* const* next, int nn, int64_t elem, const uint32_t* xt,
                                           const float* block_scales, int64_t groups, int64_t K, int64_t chunk,
                                           c10::BFloat16* tile, float* acc) {
  const int64_t stride = unpack_block(chunk);
  const AmxRowTile<Widen> t{nr, nn, widen, rows, next, elem, xt, block_scales, groups, K, chunk, stride,
                            UnpackOrder(K, chunk).len, acc};
  amx_configure();
  amx_widen_rows(t, 0, 0, nr, tile);
  for (int64_t k0 = 0, kb = 0; k0 < K; k0 += chunk, ++kb) {
    const c10::BFloat16* cur = tile + (kb & 1) * kRowTile * stride;
    c10::BFloat16* nxt = tile + ((kb + 1) & 1) * kRowTile * stride;
    if (kb & 1) amx_column_block<1>(t, k0, kb, cur, nxt);
    else amx_column_block<0>(t, k0, kb, cur, nxt);
  }
  amx_release();
}
#endif

// One row tile against token groups: acc[g * kRowTile + i][lane] = row i . token (g * kLanes + lane) for nr rows
// and g < groups, a chunk of ``chunk`` columns at a time (a multiple of the rows' column block): widen(i, k0, n,
// out) writes row i's columns [k0, k0 + n) into ``tile`` (kRowTile x tile_stride values). Two forms:
//   float32 rows against xt as tokens_across_lanes lays it out (``block_scales`` null);
//   (avx512) bfloat16 rows of E4M3 values * 2^-8 in unpack order (e4m3_unpacked) against token pairs
//   (token_pairs_across_lanes), chunk = the column block, each chunk's sums times its block scale
//   block_scales[k0 / chunk] (and 2^8).
// Meanwhile the weight widened next is prefetched: ``rows`` (byte pointers to the nr rows' starts, ``elem`` bytes
// a value) at their next chunk, after their last chunk ``next`` (nn rows, 0: none) at their first.
template <typename Tile, typename Tokens, typename Widen>
void row_tile_by_tokens(int nr, const Widen& widen, const char* const* rows, const char* const* next, int nn,
                        int64_t elem, const Tokens* xt, const float* block_scales, int64_t groups, int64_t K,
                        int64_t chunk, Tile* tile, float* acc) {
  const int64_t stride = tile_stride<Tile>(chunk), len = tile_token_len<Tile>(K, chunk);
#if GLM53_HAS_AMX
  if constexpr (!std::is_same_v<Tile, float>)
    if (amx_tiles())
      return row_tile_by_token_pairs_amx(nr, widen, rows, next, nn, elem, xt, block_scales, groups, K, chunk, tile,
                                         acc);
#endif
  for (int64_t k0 = 0, kb = 0; k0 < K; k0 += chunk, ++kb) {
    const int64_t kn = std::min(chunk, K - k0);
    for (int i = 0; i < nr; ++i) widen(i, k0, kn, tile + i * stride);
    const bool more = k0 + chunk < K;
    const int an = more ? nr : nn;
    const char* ahead[kRowTile];
    for (int i = 0; i < nr; ++i)
      ahead[i] = more ? rows[i] + (k0 + chunk) * elem : an > 0 ? next[std::min(i, an - 1)] : nullptr;
    const int64_t ahead_bytes = an > 0 ? std::min(chunk, K - (more ? k0 + chunk : 0)) * elem : 0;
    for (int64_t g = 0; g < groups; ++g) {
      const char* const* pf = g == 0 && an > 0 ? ahead : nullptr;
      auto* ag = reinterpret_cast<float(*)[kLanes]>(acc + g * kRowTile * kLanes);
      if constexpr (std::is_same_v<Tile, float>) {
        rows_by_tokens_n(nr, tile, stride, xt + (g * len + k0) * kLanes, kn, k0 > 0, pf, ahead_bytes, ag);
      } else {
#if GLM53_AVX512
        rows_by_token_pairs_n(nr, tile, stride, xt + (g * len + kb * stride) / 2 * kLanes, ceil_div(kn, 64) * 64,
                              block_scales[kb] * 0x1p8f, k0 > 0, pf, ahead_bytes, ag);
#else
        static_assert(!sizeof(Tile), "bfloat16 row tiles are the avx512 path's");
#endif
      }
    }
  }
}

// ---- block FP8 -------------------------------------------------------------------------------------------
// Block sizes are multiples of kLanes (checked by the ops), so a lane group never straddles two blocks, and a
// task's kRowsPerTask rows, starting at a multiple of kRowsPerTask inside a part, lie in one row block.

#if GLM53_AVX512
// dequantize_row (below) into bfloat16 on a CPU with bfloat16 dot products (has_bf16_dot), which it calls there:
// 32 values a step rounded by one instruction (vec.h's bf16_pack) instead of store()'s integer rounding per 16,
// which made a bfloat16 panel take 1.7x the time of a float32 one (12288 x 4096, one Zen 5 core: 5.7 against 3.2
// ms). The same values for every product of at least 2^-126 in magnitude (an E4M3 value times a block scale above
// ~2^-117).
GLM53_BF16_DOT inline void dequantize_row_bf16(const E4m3* w, const float* scale_row, int64_t len, int64_t bk,
                                               c10::BFloat16* out) {
  static_assert(kE4m3Unit == 0x1p-8f, "load(E4m3) gives value * 2^-8 on avx512");
  for (int64_t b0 = 0, kb = 0; b0 < len; b0 += bk, ++kb) {
    const F16 s = set1(scale_row[kb] * 0x1p8f);
    const int64_t b1 = std::min(b0 + bk, len);
    int64_t i = b0;
    for (; i + 2 * kLanes <= b1; i += 2 * kLanes)
      _mm512_storeu_si512(out + i, bf16_pack((load(w + i) * s).v, (load(w + i + kLanes) * s).v));
    for (; i < b1; i += kLanes) {
      const int m = static_cast<int>(std::min<int64_t>(kLanes, b1 - i));
      store(out + i, load(w + i, m) * s, m);
    }
  }
}
#endif

// out[i] = float(w[i]) * scale_row[i / bk], i < len: one weight row dequantized. Each value is first brought to
// value * 2^-8 (exact: a power of two, and every E4M3 value times 2^-8 is a normal float32), then multiplied by
// scale * 2^8 (exact), so each product is float(w) * scale rounded once: the float32 values of the reference
// dequantization (quant/fp8_block.py), bit for bit, with no overflow for any finite scale below 2^120.
// With a 16-bit ``out`` each value is that float32 product rounded once (to nearest even), as torch's .to() rounds
// the reference's float32 values.
template <typename T>
inline void dequantize_row(const E4m3* w, const float* scale_row, int64_t len, int64_t bk, T* out) {
#if GLM53_AVX512
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    if (has_bf16_dot()) return dequantize_row_bf16(w, scale_row, len, bk, out);
#endif
  const F16 to_unit8 = set1(0x1p-8f / kE4m3Unit);
  for (int64_t b0 = 0, kb = 0; b0 < len; b0 += bk, ++kb) {
    const F16 s = set1(scale_row[kb] * 0x1p8f);
    const int64_t b1 = std::min(b0 + bk, len);
    for (int64_t i = b0; i < b1; i += kLanes) {
      const int m = static_cast<int>(std::min<int64_t>(kLanes, b1 - i));
      F16 v = load(w + i, m);
      if constexpr (kE4m3Unit != 0x1p-8f) v = v * to_unit8;
      store(out + i, v * s, m);
    }
  }
}


// The block sizes and scale grid the block-FP8 ops accept ("what": the op, for the message).
inline void check_fp8_blocks(const char* what, int64_t block_n, int64_t block_k) {
  TORCH_CHECK(block_n > 0 && block_k > 0 && block_n % kRowsPerTask == 0 && block_k % kLanes == 0, what,
              ": block sizes must be positive multiples of ", kRowsPerTask, " (rows) and ", kLanes,
              " (columns), got [", block_n, ", ", block_k, "]");
}

}  // namespace glm53
