// A 16-lane float vector, the one abstraction the kernels are written in.
//
// Three instruction sets, chosen by the compiler flags the build passes (vllm_glm53/backends/cpu/build.py builds
// one library per instruction set the CPU runs):
//   avx512    one zmm register per lane group; partial groups use masked loads and stores.
//   avx2      two ymm registers (AVX2 + FMA, F16C for float16); partial groups use masked float loads and
//             stores, and a zero-padded copy for 16-bit types (AVX2 has no 16-bit masked moves).
//   portable  a plain 16-float array whose loops the compiler vectorises for whatever the target offers (the
//             x86-64 baseline, SSE2): for CPUs without AVX2.
// The kernels have one source, so every path is checked by the same tests. The avx512 and avx2 paths compute
// the same values bit for bit (same exp polynomial and 2^n scaling, same reduction tree, fused multiply-adds);
// the portable path rounds fma() as a multiply then an add (a correctly rounded fma without the instruction is
// a libm call per lane, which made it ~30x slower than avx2) and takes exp from std::exp. The kernels size their
// register tiles with kVectorRegs.
//
// Every operation takes the number of valid lanes ``n`` (1..16) where memory is touched; lanes past ``n`` load
// as zero and are never stored.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(GLM53_EMULATED_AVX512)
// Tests only: the avx512 path on a CPU without AVX-512, its intrinsics from tests/avx512_emulation.h (force-
// included by the build that defines this; tests/kernel_isas.py).
#define GLM53_AVX512 1
#define GLM53_AVX2 0
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define GLM53_AVX512 1
#define GLM53_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GLM53_AVX512 0
#define GLM53_AVX2 1
#else
#define GLM53_AVX512 0
#define GLM53_AVX2 0
#endif

namespace glm53 {

constexpr int kLanes = 16;

// A float8_e4m3fn weight byte (torch's layout: sign, 4 exponent bits with bias 7, 3 mantissa bits). load() of
// E4M3 bytes returns each value times kE4m3Unit, a power of two for which the byte's bits, moved into place, are
// already that float, subnormals included, so the conversion is a few integer operations with no table and no
// special cases:
//   avx512, portable  2^-8: the low seven bits shifted left by 7 with the sign on top are a float16 of value * 2^-8
//                     (exponent bias 15 = 7 + 8), widened by the float16 -> float32 instruction (the portable
//                     path tabulates the same 256 values);
//   avx2              2^-120: the low seven bits shifted left by 20 with the sign on top are a float32 of
//                     value * 2^-120 (bias 127 = 7 + 120; E4M3 subnormals become float32 subnormals, exactly).
// Kernels fold 1 / kE4m3Unit into their block scales (gemv.h). The one code that differs: e4m3fn's NaN
// (0x7F / 0xFF) reads as +-480, a finite value; block-FP8 quantizers never write it (quant/fp8_block.py rejects
// non-finite weights).
struct E4m3 {
  uint8_t bits;
};

// How many 16-lane vectors the register file holds: the kernels' register tiles (accumulators kept across a
// loop) are sized so they do not spill.
#if GLM53_AVX512
constexpr int kVectorRegs = 32;  // zmm0-31
#elif GLM53_AVX2
constexpr int kVectorRegs = 8;   // ymm0-15, two per vector
#else
constexpr int kVectorRegs = 4;   // xmm0-15 (SSE2), four per vector
#endif

#if GLM53_AVX512

inline const char* isa_name() { return "avx512"; }

constexpr float kE4m3Unit = 0x1p-8f;

// 16 E4M3 bytes -> 16 float16 bit patterns of value * 2^-8 (see E4m3): the sign extension puts the sign in bit
// 15 and a copy in bit 14, which the mask clears (the top float16 exponent bit stays 0).
inline __m256i e4m3_half_bits(__m128i b) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
}

struct F16 {
  __m512 v;
};

inline __mmask16 lane_mask(int n) { return n >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

inline F16 zero() { return {_mm512_setzero_ps()}; }
inline F16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline F16 load(const float* p, int n = kLanes) {
  return {n >= kLanes ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(lane_mask(n), p)};
}
inline F16 load(const c10::BFloat16* p, int n = kLanes) {
  // bf16 is the top half of a float: widen to 32 bits and shift into place.
  __m256i h = _mm256_maskz_loadu_epi16(lane_mask(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline F16 load(const c10::Half* p, int n = kLanes) {
  __m256i h = _mm256_maskz_loadu_epi16(lane_mask(n), p);
  return {_mm512_cvtph_ps(h)};
}
// E4M3 bytes (see E4m3 at the top): sign-extend to 16 bits, shift into float16 position, convert with the F16C path.
inline F16 load(const E4m3* p, int n = kLanes) {
  const __m128i b = n >= kLanes ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                                : _mm_maskz_loadu_epi8(lane_mask(n), p);
  return {_mm512_cvtph_ps(e4m3_half_bits(b))};
}
inline void store(float* p, F16 x, int n = kLanes) {
  if (n >= kLanes) _mm512_storeu_ps(p, x.v);
  else _mm512_mask_storeu_ps(p, lane_mask(n), x.v);
}
// Narrowing stores round to nearest even, as torch's .to(bfloat16 / float16) does; a NaN stays a (quiet) NaN.
inline void store(c10::BFloat16* p, F16 x, int n = kLanes) {
  __m512i b = _mm512_castps_si512(x.v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, lane_mask(n), _mm512_cvtepi32_epi16(r));
}
inline void store(c10::Half* p, F16 x, int n = kLanes) {
  _mm256_mask_storeu_epi16(p, lane_mask(n), _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline F16 operator+(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 operator-(F16 a, F16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F16 operator*(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 operator/(F16 a, F16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F16 fma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline F16 vmin(F16 a, F16 b) { return {_mm512_min_ps(a.v, b.v)}; }  // a < b ? a : b
inline F16 vmax(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F16 relu(F16 a) { return {_mm512_max_ps(a.v, _mm512_setzero_ps())}; }
// Halves, then quarters, then pairs: the tree every path sums in (see the avx2 and portable paths).
inline float reduce_add(F16 a) {
  const __m256 s8 = _mm256_add_ps(_mm512_extractf32x8_ps(a.v, 1), _mm512_castps512_ps256(a.v));
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}
// reduce_add of 16 vectors at once: lane i of the result is reduce_add(v[i]), bit for bit (the same tree, lanes 8
// apart, then 4, 2 and 1) in 45 shuffles and adds, where 16 reductions to scalars take 8 each and a store. Every
// level adds two shuffles of each vector pair, halving the vectors and each row's lanes; fed in order, row i's sum
// would end in the lane that swaps bits 0 and 1 and bits 2 and 3 of i, so the rows go in in that order (the swap
// is its own inverse).
inline F16 reduce_add16(const F16 (&v)[kLanes]) {
  constexpr auto slot = [](int i) { return (i & 0b0101) << 1 | (i & 0b1010) >> 1; };
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // lanes 8 apart: the low 256 bits of both plus their high ones
    const __m512 x = v[slot(i)].v, y = v[slot(i + 8)].v;
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int i = 0; i < 4; ++i)  // 4 apart: 128-bit lanes 0 and 2 plus 1 and 3
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // 2 apart, within 128-bit lanes
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[i], b[i + 2], 0x44), _mm512_shuffle_ps(b[i], b[i + 2], 0xEE));
  return {_mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD))};  // 1 apart
}
inline float reduce_max(F16 a) { return _mm512_reduce_max_ps(a.v); }

// exp with Cody-Waite range reduction and a degree-6 polynomial (about 1 ulp on the range used here).
// Inputs are clamped to [-104, 89]: below, the result is exactly 0 (exp(-inf) = 0 is relied on by the online
// softmax); above, scalef overflows to +inf as exp does.
inline F16 exp(F16 x) {
  __m512 v = _mm512_min_ps(_mm512_max_ps(x.v, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return {_mm512_scalef_ps(p, n)};
}

// bfloat16 pairs: 16 32-bit lanes of two bfloat16 values each (the lower column in the low half). On CPUs with
// AVX512_BF16, vdpbf16ps adds both products of each lane's pair to a float32 lane (products exact, two roundings:
// the odd column's product first, inputs and results below 2^-126 flushed to zero), 32 products per instruction
// against the float32 FMA's 16. Not part of the avx512 flags the library is built with: the functions that use it
// are compiled for it on their own (GLM53_BF16_DOT), and has_bf16_dot() says at run time whether they may be
// called. The E4M3 conversion below needs nothing beyond AVX512BW, so Intel's Cooper Lake (AVX512_BF16 without
// AVX512_VBMI, whose byte lookups the tile path's conversion used to take) multiplies on the pairs as well.
#if defined(GLM53_EMULATED_AVX512)
#define GLM53_BF16_DOT
inline bool has_bf16_dot() { return true; }  // the emulation's own instruction (tests/avx512_emulation.h)
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) { return glm53_emulation::dpbf16_ps(acc, a, b); }
#else
#define GLM53_BF16_DOT __attribute__((target("avx512bf16")))
inline bool has_bf16_dot() { return __builtin_cpu_supports("avx512bf16"); }
GLM53_BF16_DOT inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
#endif
// 32 floats (lo the first 16, then hi) as bfloat16, rounded to nearest even by one vcvtne2ps2bf16 (AVX512_BF16, as
// dot_pairs). Unlike store()'s rounding it takes inputs below 2^-126 as zero and quiets a NaN by its own rule (the
// top half with the quiet bit set rather than 0x7FC0); weights dequantized from E4M3 with a checkpoint's scales
// never come near either.
#if defined(GLM53_EMULATED_AVX512)
inline __m512i bf16_pack(__m512 lo, __m512 hi) { return glm53_emulation::cvtne2ps_pbh(hi, lo); }
#else
GLM53_BF16_DOT inline __m512i bf16_pack(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }
#endif

// The bfloat16 bits of value * 2^-8 for the E4M3 magnitudes 0-127 (sign bit clear): eeee mmm with e > 0 is
// 1.mmm * 2^(e - 15), exponent field e + 112; e = 0 is m * 2^-17 (m = 1: 2^-17, 2-3: [1, 1.5] * 2^-16, 4-7:
// [1, 1.75] * 2^-15). 127 (a NaN in E4M3) maps to 1.875, as the other magnitudes' formula gives and the float32
// path's conversion does; checkpoints hold no NaN.
constexpr uint16_t e4m3_bf16_bits(int mag) {
  const int e = mag >> 3, m = mag & 7;
  if (e > 0) return static_cast<uint16_t>((e + 112) << 7 | m << 4);
  if (m == 0) return 0;
  const int p = m >= 4 ? 2 : m >= 2 ? 1 : 0;  // floor(log2 m)
  return static_cast<uint16_t>((110 + p) << 7 | (m << (7 - p) & 0x7F));
}

// 64 E4M3 bytes (load_e4m3_64: the first n, the rest zero) as the bfloat16 values of value * 2^-8 in two registers
// (unpacked_half), for dot_pairs against tokens in "unpack order" (gemv.h's UnpackOrder): the low half holds bytes
// 0-7, 16-23, 32-39 and 48-55, the high half bytes 8-15, 24-31, 40-47 and 56-63 (the low and the high 8 bytes of
// each 128-bit lane). Each byte is copied into both halves of a 16-bit lane (vpunpck[lh]bw, within 128-bit
// lanes), and an arithmetic shift right by 4 puts its exponent and mantissa where bfloat16 has them with copies of
// the sign above; one vpternlogd keeps the top sign bit and ORs in 112 (the exponent bias difference 127 - 7 - 8,
// in bits above the four E4M3 exponent bits): exact for every byte with a non-zero exponent field. Zero and the
// subnormals (exponent field 0: ~1e-4 of a block-scaled weight's values, and a short group's padding) are looked
// up by their mantissa behind a branch. 4 instructions per 32 values (one a shuffle) against 5 for byte lookups in
// a 128-entry table (three shuffles, AVX512_VBMI's vpermb and vpermi2b, sharing a port with vdpbf16ps): a row pair
// against one token from L2 on one Zen 5 core, 63-69 GB/s against 48-51 with the lookups and 33 on the float32
// path (benchmarks/README.md).
GLM53_BF16_DOT inline __m512i load_e4m3_64(const E4m3* p, int n) {
  return n >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((__mmask64(1) << n) - 1, p);
}
// Whether all 64 bytes have a non-zero exponent field: then both halves take unpacked_half's formula alone (one
// test of the bytes instead of one per half).
GLM53_BF16_DOT inline bool e4m3_all_normal(__m512i b) {
  return _mm512_test_epi8_mask(b, _mm512_set1_epi8(0x78)) == ~__mmask64(0);
}
// The low or (kHigh) the high half of 64 bytes from load_e4m3_64, as described above. kNormal: the caller found
// every byte normal (e4m3_all_normal).
template <bool kHigh, bool kNormal = false>
GLM53_BF16_DOT inline __m512i unpacked_half(__m512i b) {
  const __m512i l = kHigh ? _mm512_unpackhi_epi8(b, b) : _mm512_unpacklo_epi8(b, b);
  const __m512i v = _mm512_ternarylogic_epi32(_mm512_srai_epi16(l, 4), _mm512_set1_epi16(static_cast<short>(0x87F0)),
                                              _mm512_set1_epi16(0x3800), 0xEA);  // (l >> 4) & 0x87F0 | 0x3800
  if constexpr (kNormal) return v;
  const __mmask32 normal = _mm512_test_epi16_mask(l, _mm512_set1_epi16(0x7800));
  if (__builtin_expect(normal == ~__mmask32(0), 1)) return v;
  // exponent field 0: the value is mantissa * 2^-17, the low five bits of the lane (the byte's) index it
  alignas(64) static constexpr uint16_t kExponent0[32] = {e4m3_bf16_bits(0), e4m3_bf16_bits(1), e4m3_bf16_bits(2),
                                                          e4m3_bf16_bits(3), e4m3_bf16_bits(4), e4m3_bf16_bits(5),
                                                          e4m3_bf16_bits(6), e4m3_bf16_bits(7)};
  const __m512i fixed = _mm512_ternarylogic_epi32(_mm512_permutexvar_epi16(l, _mm512_load_si512(kExponent0)), l,
                                                  _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);
  return _mm512_mask_mov_epi16(v, ~normal, fixed);
}

#elif GLM53_AVX2

inline const char* isa_name() { return "avx2"; }

constexpr float kE4m3Unit = 0x1p-120f;

// 16 E4M3 bytes (in both 128-bit halves) -> the float32 bits of bytes kLo..kLo+7 times 2^-120 (see E4m3): the
// byte shuffle puts byte kLo + k in the top byte of lane k (each half picks its four bytes from its own copy, so
// nothing crosses the halves), the arithmetic shift moves it down to the exponent and mantissa and copies the
// sign into bits 31-27, and the mask keeps the copy in bit 31 only. Two shuffle-unit operations per 8 weights,
// against the float16 route's unpack, shift and two-operation float16 -> float32 conversion: 1.4x the weights per
// second from cache on AMD Zen 3, where that conversion used to bound FP8 decode (benchmarks/README.md).
template <int kLo>
inline __m256 e4m3_floats(__m256i both) {
  constexpr char z = -1;  // shuffle index with the top bit set: a zero byte
  const __m256i pick = _mm256_setr_epi8(z, z, z, kLo, z, z, z, kLo + 1, z, z, z, kLo + 2, z, z, z, kLo + 3,
                                        z, z, z, kLo + 4, z, z, z, kLo + 5, z, z, z, kLo + 6, z, z, z, kLo + 7);
  const __m256i bits = _mm256_srai_epi32(_mm256_shuffle_epi8(both, pick), 4);
  return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x87FFFFFFu))));
}

struct F16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

// All-ones in the 32-bit lanes below n (n may be <= 0 or >= 8).
inline __m256i lane_mask8(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 set1(float x) {
  const __m256 v = _mm256_set1_ps(x);
  return {v, v};
}
inline F16 load(const float* p, int n = kLanes) {
  if (n >= kLanes) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  // Masked-off lanes are not read (no fault past the end of the data).
  return {_mm256_maskload_ps(p, lane_mask8(n)), _mm256_maskload_ps(p + 8, lane_mask8(n - 8))};
}
// 16 raw 16-bit values; a partial group is copied into a zeroed buffer first.
inline __m256i load_u16(const void* p, int n) {
  if (n >= kLanes) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint16_t buf[kLanes] = {};
  std::memcpy(buf, p, sizeof(uint16_t) * n);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}
inline __m256 bf16_to_f32(__m128i h) {  // bf16 is the top half of a float
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline F16 load(const c10::BFloat16* p, int n = kLanes) {
  const __m256i h = load_u16(p, n);
  return {bf16_to_f32(_mm256_castsi256_si128(h)), bf16_to_f32(_mm256_extracti128_si256(h, 1))};
}
inline F16 load(const c10::Half* p, int n = kLanes) {
  const __m256i h = load_u16(p, n);
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
// E4M3 bytes (see E4m3 at the top); a partial group is copied into a zeroed buffer first.
inline F16 load(const E4m3* p, int n = kLanes) {
  __m128i b;
  if (n >= kLanes) {
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint8_t buf[kLanes] = {};
    std::memcpy(buf, p, n);
    b = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
  }
  const __m256i both = _mm256_broadcastsi128_si256(b);
  return {e4m3_floats<0>(both), e4m3_floats<8>(both)};
}
inline void store(float* p, F16 x, int n = kLanes) {
  if (n >= kLanes) {
    _mm256_storeu_ps(p, x.lo);
    _mm256_storeu_ps(p + 8, x.hi);
  } else {
    _mm256_maskstore_ps(p, lane_mask8(n), x.lo);
    _mm256_maskstore_ps(p + 8, lane_mask8(n - 8), x.hi);
  }
}
inline void store_u16(void* p, __m256i h, int n) {
  if (n >= kLanes) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), h);
  } else {
    alignas(32) uint16_t buf[kLanes];
    _mm256_store_si256(reinterpret_cast<__m256i*>(buf), h);
    std::memcpy(p, buf, sizeof(uint16_t) * n);
  }
}
// Narrowing stores round to nearest even, as torch's .to(bfloat16 / float16) does; a NaN stays a (quiet) NaN.
inline __m256i bf16_bits(__m256 x) {  // in the low 16 bits of each 32-bit lane
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
inline void store(c10::BFloat16* p, F16 x, int n = kLanes) {
  // packus works within 128-bit halves (lo0-3 hi0-3 lo4-7 hi4-7); the permute puts the quarters in order.
  // The values are 0..0xFFFF, so the unsigned saturation never triggers.
  const __m256i packed = _mm256_packus_epi32(bf16_bits(x.lo), bf16_bits(x.hi));
  store_u16(p, _mm256_permute4x64_epi64(packed, 0xD8), n);
}
inline void store(c10::Half* p, F16 x, int n = kLanes) {
  const __m128i lo = _mm256_cvtps_ph(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m128i hi = _mm256_cvtps_ph(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  store_u16(p, _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1), n);
}
inline F16 operator+(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 operator-(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F16 operator*(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 operator/(F16 a, F16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F16 fma(F16 a, F16 b, F16 c) {  // a * b + c
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 vmin(F16 a, F16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }  // a < b ? a : b
inline F16 vmax(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F16 relu(F16 a) { return vmax(a, zero()); }
// The avx512 path's reduction tree (halves, then quarters, then pairs): both paths sum in the same order.
inline float reduce_add8(__m256 s8) {  // from the quarters on
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}
inline float reduce_add(F16 a) { return reduce_add8(_mm256_add_ps(a.hi, a.lo)); }
// reduce_add8 of 8 vectors at once: lane i of the result is reduce_add8(v[i]), bit for bit (the same tree, lanes 4
// apart, then 2 and 1) in 21 shuffles and adds. As in the avx512 path's reduce_add16, the rows go in with bits 0
// and 1 of their index swapped, which puts row i's sum in lane i.
inline __m256 reduce_add8x8(const __m256* v) {
  constexpr auto slot = [](int i) { return (i & 0b100) | (i & 1) << 1 | (i & 2) >> 1; };
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i) {  // lanes 4 apart: the low 128 bits of both plus their high ones
    const __m256 x = v[slot(i)], y = v[slot(i + 4)];
    a[i] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  }
  for (int i = 0; i < 2; ++i)  // 2 apart, within 128-bit lanes
    b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[i], a[i + 2], 0x44), _mm256_shuffle_ps(a[i], a[i + 2], 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x88), _mm256_shuffle_ps(b[0], b[1], 0xDD));  // 1 apart
}
inline float reduce_max(F16 a) {
  const __m256 s8 = _mm256_max_ps(a.hi, a.lo);
  const __m128 s4 = _mm_max_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_max_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(s2), _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1)));
}

// The avx512 path's exp step for step. AVX2 has no scalef: 2^n is applied as two power-of-two factors
// 2^(n>>1) and 2^(n - (n>>1)), each a normal float over the whole clamped range (n in [-150, 128]); the first
// product is exact, so the result is rounded once, as scalef rounds it (denormals and overflow to +inf alike).
inline __m256 exp8(__m256 x) {
  const __m256 v = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}
inline F16 exp(F16 x) { return {exp8(x.lo), exp8(x.hi)}; }

#else  // portable

inline const char* isa_name() { return "portable"; }

constexpr float kE4m3Unit = 0x1p-8f;

struct F16 {
  float v[kLanes];
};

inline F16 zero() {
  F16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = 0.0f;
  return r;
}
inline F16 set1(float x) {
  F16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = x;
  return r;
}
template <typename T>
inline F16 load(const T* p, int n = kLanes) {
  F16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = i < n ? static_cast<float>(p[i]) : 0.0f;
  return r;
}
// E4M3 bytes (see E4m3 at the top) through a table of the 256 values, built once from the same float16 bit pattern.
inline const std::array<float, 256> kE4m3Table = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const uint16_t bits = static_cast<uint16_t>((static_cast<uint16_t>(static_cast<int8_t>(b)) << 7) & 0xBF80u);
    t[b] = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  }
  return t;
}();
inline F16 load(const E4m3* p, int n = kLanes) {
  F16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = i < n ? kE4m3Table[p[i].bits] : 0.0f;
  return r;
}
inline void store(float* p, F16 x, int n = kLanes) {
  for (int i = 0; i < std::min(n, kLanes); ++i) p[i] = x.v[i];
}
// bfloat16 / float16 destinations: c10's conversions round to nearest even, as torch's .to() does.
template <typename T>
inline void store(T* p, F16 x, int n = kLanes) {
  for (int i = 0; i < std::min(n, kLanes); ++i) p[i] = static_cast<T>(x.v[i]);
}
#define GLM53_LANEWISE(expr) \
  F16 r;                     \
  for (int i = 0; i < kLanes; ++i) r.v[i] = (expr); \
  return r;
inline F16 operator+(F16 a, F16 b) { GLM53_LANEWISE(a.v[i] + b.v[i]) }
inline F16 operator-(F16 a, F16 b) { GLM53_LANEWISE(a.v[i] - b.v[i]) }
inline F16 operator*(F16 a, F16 b) { GLM53_LANEWISE(a.v[i] * b.v[i]) }
inline F16 operator/(F16 a, F16 b) { GLM53_LANEWISE(a.v[i] / b.v[i]) }
inline F16 fma(F16 a, F16 b, F16 c) { GLM53_LANEWISE(a.v[i] * b.v[i] + c.v[i]) }  // two roundings (see top)
inline F16 vmin(F16 a, F16 b) { GLM53_LANEWISE(a.v[i] < b.v[i] ? a.v[i] : b.v[i]) }  // as the vector paths'
inline F16 vmax(F16 a, F16 b) { GLM53_LANEWISE(std::max(a.v[i], b.v[i])) }
inline F16 relu(F16 a) { GLM53_LANEWISE(std::max(a.v[i], 0.0f)) }
inline F16 exp(F16 x) { GLM53_LANEWISE(std::exp(x.v[i])) }
#undef GLM53_LANEWISE
// The vector paths' reduction tree (halves, then quarters, then pairs), so sums round alike on every path.
inline float reduce_add(F16 a) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a.v[i + 8] + a.v[i];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i + 4] + s8[i];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
inline float reduce_max(F16 a) {
  float m = a.v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, a.v[i]);
  return m;
}

#endif

// ---- small helpers on float arrays ----------------------------------------------------------------------

// sum_i a[i] * b[i] in float32, four partial sums so the FMA chains overlap.
template <typename TB>
inline float dot(const float* a, const TB* b, int64_t n) {
  F16 s0 = zero(), s1 = zero(), s2 = zero(), s3 = zero();
  int64_t i = 0;
  // Lane counts spelled out: a one-argument load(b) of a c10 type would also match c10::load by ADL.
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    s0 = fma(load(a + i, kLanes), load(b + i, kLanes), s0);
    s1 = fma(load(a + i + kLanes, kLanes), load(b + i + kLanes, kLanes), s1);
    s2 = fma(load(a + i + 2 * kLanes, kLanes), load(b + i + 2 * kLanes, kLanes), s2);
    s3 = fma(load(a + i + 3 * kLanes, kLanes), load(b + i + 3 * kLanes, kLanes), s3);
  }
  for (; i < n; i += kLanes) {
    int m = static_cast<int>(std::min<int64_t>(kLanes, n - i));
    s0 = fma(load(a + i, m), load(b + i, m), s0);
  }
  return reduce_add((s0 + s1) + (s2 + s3));
}

// dst[0..n) = float(src[0..n)).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    int m = static_cast<int>(std::min<int64_t>(kLanes, n - i));
    store(dst + i, load(src + i, m), m);
  }
}

// dst[0..n) = src[0..n) rounded once to T (to nearest even; a plain copy for float). Inline: the rows it copies are
// short, and std::copy's library call per row cost more than the KDA decode recurrence that copies its state rows.
template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const int m = static_cast<int>(std::min<int64_t>(kLanes, n - i));
    store(dst + i, load(src + i, m), m);
  }
}

}  // namespace glm53
