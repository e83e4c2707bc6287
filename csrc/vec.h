// A 16-lane float vector, the one abstraction the kernels are written in.
//
// With AVX-512 (the build passes -mavx512f/bw/vl/dq when the CPU has them) a lane group is one zmm register and
// partial groups use masked loads/stores. Without it the same type is a plain 16-float array whose loops the
// compiler vectorises for whatever the target offers: the kernels have one source and two instruction sets, so
// the portable build is checked by the same tests.
//
// Every operation takes the number of valid lanes ``n`` (1..16) where memory is touched; lanes past ``n`` load
// as zero and are never stored.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define GLM53_AVX512 1
#else
#define GLM53_AVX512 0
#endif

namespace glm53 {

constexpr int kLanes = 16;

#if GLM53_AVX512

inline const char* isa_name() { return "avx512"; }

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
inline F16 vmax(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F16 relu(F16 a) { return {_mm512_max_ps(a.v, _mm512_setzero_ps())}; }
inline float reduce_add(F16 a) { return _mm512_reduce_add_ps(a.v); }
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

#else  // portable

inline const char* isa_name() { return "portable"; }

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
inline F16 fma(F16 a, F16 b, F16 c) { GLM53_LANEWISE(std::fma(a.v[i], b.v[i], c.v[i])) }
inline F16 vmax(F16 a, F16 b) { GLM53_LANEWISE(std::max(a.v[i], b.v[i])) }
inline F16 relu(F16 a) { GLM53_LANEWISE(std::max(a.v[i], 0.0f)) }
inline F16 exp(F16 x) { GLM53_LANEWISE(std::exp(x.v[i])) }
#undef GLM53_LANEWISE
inline float reduce_add(F16 a) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += a.v[i];
  return s;
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
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    s0 = fma(load(a + i), load(b + i), s0);
    s1 = fma(load(a + i + kLanes), load(b + i + kLanes), s1);
    s2 = fma(load(a + i + 2 * kLanes), load(b + i + 2 * kLanes), s2);
    s3 = fma(load(a + i + 3 * kLanes), load(b + i + 3 * kLanes), s3);
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

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace glm53
