// Tests only: the avx512 path of csrc/vec.h on a CPU without AVX-512, so its arithmetic is checked on every
// machine that runs the suite (tests/kernel_isas.py builds the kernels with this header force-included and
// GLM53_EMULATED_AVX512 defined, which makes vec.h take its avx512 branch).
//
// SIMDe (Debian's libsimde-dev) implements the AVX-512 intrinsics on AVX2 and aliases them to their usual names.
// The intrinsics vec.h uses that its 0.7 release lacks are written below as plain loops over the lanes, each
// doing what Intel's documentation says the instruction does; masked loads read only the lanes their mask
// selects, as the instructions do.
#pragma once

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace glm53_emulation {

template <typename V, typename T, int N>
inline V lanes_to(const T (&lanes)[N]) {
  static_assert(sizeof(V) == sizeof(lanes));
  V v;
  std::memcpy(&v, lanes, sizeof(v));
  return v;
}

template <typename T, int N, typename V>
inline void lanes_of(const V& v, T (&lanes)[N]) {
  static_assert(sizeof(V) == sizeof(lanes));
  std::memcpy(lanes, &v, sizeof(v));
}

template <typename V, typename T, int N>
inline V masked_load(uint64_t mask, const void* p) {
  T lanes[N] = {};
  for (int i = 0; i < N; ++i)
    if (mask >> i & 1u) std::memcpy(&lanes[i], static_cast<const char*>(p) + i * sizeof(T), sizeof(T));
  return lanes_to<V>(lanes);
}

template <typename T, int N, typename V>
inline void masked_store(void* p, uint32_t mask, const V& v) {
  T lanes[N];
  lanes_of(v, lanes);
  for (int i = 0; i < N; ++i)
    if (mask >> i & 1u) std::memcpy(static_cast<char*>(p) + i * sizeof(T), &lanes[i], sizeof(T));
}

inline simde__m512 maskz_loadu_ps(simde__mmask16 k, const void* p) { return masked_load<simde__m512, float, 16>(k, p); }
inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 a) { masked_store<float, 16>(p, k, a); }
inline __m256i maskz_loadu_epi16(simde__mmask16 k, const void* p) { return masked_load<__m256i, uint16_t, 16>(k, p); }
inline void mask_storeu_epi16(void* p, simde__mmask16 k, __m256i a) { masked_store<uint16_t, 16>(p, k, a); }
inline __m128i maskz_loadu_epi8(simde__mmask16 k, const void* p) { return masked_load<__m128i, uint8_t, 16>(k, p); }
inline simde__m512i maskz_loadu_epi16_512(simde__mmask32 k, const void* p) {
  return masked_load<simde__m512i, uint16_t, 32>(k, p);
}
inline __m256i maskz_loadu_epi8_256(simde__mmask32 k, const void* p) { return masked_load<__m256i, uint8_t, 32>(k, p); }
inline simde__m512i maskz_loadu_epi8_512(simde__mmask64 k, const void* p) {
  return masked_load<simde__m512i, uint8_t, 64>(k, p);
}
inline void mask_storeu_epi16_512(void* p, simde__mmask32 k, simde__m512i a) { masked_store<uint16_t, 32>(p, k, a); }

inline __m256 extractf32x8_ps(simde__m512 a, int half) {
  float f[16];
  lanes_of(a, f);
  return _mm256_loadu_ps(f + 8 * half);
}

inline simde__m512i cvtepu16_epi32(__m256i a) {
  uint16_t h[16];
  uint32_t w[16];
  lanes_of(a, h);
  for (int i = 0; i < 16; ++i) w[i] = h[i];
  return lanes_to<simde__m512i>(w);
}

inline __m256i cvtepi32_epi16(simde__m512i a) {  // truncates each lane to its low 16 bits
  uint32_t w[16];
  uint16_t h[16];
  lanes_of(a, w);
  for (int i = 0; i < 16; ++i) h[i] = static_cast<uint16_t>(w[i]);
  return lanes_to<__m256i>(h);
}

// float16 <-> float32 with the F16C instructions, one half of the lanes at a time.
inline simde__m512 cvtph_ps(__m256i a) {
  float f[16];
  _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm256_castsi256_si128(a)));
  _mm256_storeu_ps(f + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)));
  return lanes_to<simde__m512>(f);
}
#define GLM53_EMULATION_CVTPS_PH(a, rounding) \
  _mm256_set_m128i(_mm256_cvtps_ph(glm53_emulation::extractf32x8_ps(a, 1), rounding), \
                   _mm256_cvtps_ph(glm53_emulation::extractf32x8_ps(a, 0), rounding))

inline float reduce_max_ps(simde__m512 a) {  // maxps's rule (a > b ? a : b) over halves, quarters, pairs
  float f[16];
  lanes_of(a, f);
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) f[i] = f[i] > f[i + width] ? f[i] : f[i + width];
  return f[0];
}

// AVX512_BF16's vdpbf16ps as Intel documents it: per 32-bit lane, acc + a.odd * b.odd, then + a.even * b.even
// (bfloat16 values widened to float32; the products are exact), inputs and results below 2^-126 as zero. On an
// AMD EPYC Zen 4, moe_experts_fp8's outputs through this and through the instruction were equal bit for bit.
inline float flush_denormal(float v) { return std::fabs(v) < 0x1p-126f ? 0.0f * v : v; }
inline simde__m512 dpbf16_ps(simde__m512 acc, simde__m512i a, simde__m512i b) {
  float s[16];
  uint16_t ah[32], bh[32];
  lanes_of(acc, s);
  lanes_of(a, ah);
  lanes_of(b, bh);
  const auto widen = [](uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return flush_denormal(f);
  };
  for (int i = 0; i < 16; ++i) {
    const float odd = flush_denormal(flush_denormal(s[i]) + widen(ah[2 * i + 1]) * widen(bh[2 * i + 1]));
    s[i] = flush_denormal(odd + widen(ah[2 * i]) * widen(bh[2 * i]));
  }
  return lanes_to<simde__m512>(s);
}

// AVX512_BF16's vcvtne2ps2bf16 as Intel documents it: 32 bfloat16 values, b's 16 floats in the low half and a's in
// the high half, each rounded to nearest even; inputs below 2^-126 as zero (keeping their sign), a NaN quieted
// (its top 16 bits with the quiet bit set).
inline simde__m512i cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
  uint32_t bits[32];
  lanes_of(b, *reinterpret_cast<uint32_t(*)[16]>(bits));
  lanes_of(a, *reinterpret_cast<uint32_t(*)[16]>(bits + 16));
  uint16_t h[32];
  for (int i = 0; i < 32; ++i) {
    uint32_t x = bits[i];
    if ((x & 0x7F800000u) == 0x7F800000u && (x & 0x007FFFFFu) != 0) {
      h[i] = static_cast<uint16_t>(x >> 16 | 0x40u);
      continue;
    }
    if ((x & 0x7F800000u) == 0) x &= 0x80000000u;
    h[i] = static_cast<uint16_t>((x + 0x7FFFu + (x >> 16 & 1u)) >> 16);
  }
  return lanes_to<simde__m512i>(h);
}

}  // namespace glm53_emulation

#define _mm512_maskz_loadu_ps(k, p) glm53_emulation::maskz_loadu_ps(k, p)
#define _mm512_mask_storeu_ps(p, k, a) glm53_emulation::mask_storeu_ps(p, k, a)
#define _mm256_maskz_loadu_epi16(k, p) glm53_emulation::maskz_loadu_epi16(k, p)
#define _mm256_mask_storeu_epi16(p, k, a) glm53_emulation::mask_storeu_epi16(p, k, a)
#define _mm_maskz_loadu_epi8(k, p) glm53_emulation::maskz_loadu_epi8(k, p)
#define _mm512_maskz_loadu_epi16(k, p) glm53_emulation::maskz_loadu_epi16_512(k, p)
#define _mm256_maskz_loadu_epi8(k, p) glm53_emulation::maskz_loadu_epi8_256(k, p)
#define _mm512_maskz_loadu_epi8(k, p) glm53_emulation::maskz_loadu_epi8_512(k, p)
#define _mm512_mask_storeu_epi16(p, k, a) glm53_emulation::mask_storeu_epi16_512(p, k, a)
#define _mm512_extractf32x8_ps(a, half) glm53_emulation::extractf32x8_ps(a, half)
#define _mm512_cvtepu16_epi32(a) glm53_emulation::cvtepu16_epi32(a)
#define _mm512_cvtepi32_epi16(a) glm53_emulation::cvtepi32_epi16(a)
#define _mm512_cvtph_ps(a) glm53_emulation::cvtph_ps(a)
#define _mm512_cvtps_ph(a, rounding) GLM53_EMULATION_CVTPS_PH(a, rounding)
#define _mm512_reduce_max_ps(a) glm53_emulation::reduce_max_ps(a)
// implemented by SIMDe 0.7 but not aliased to its usual name
#define _mm512_shuffle_f32x4(a, b, imm) simde_mm512_shuffle_f32x4(a, b, imm)
