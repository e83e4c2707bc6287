// What every kernel file shares besides vec.h: the dtype dispatch for cache rows and activations.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "vec.h"

// at::parallel_for's grain for loops over tokens (rows) of ``values_per_token`` values each: splitting fewer than
// 2^15 values a thread over threads costs more than it saves.
inline int64_t token_grain(int64_t values_per_token) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / values_per_token);
}

// Sum of the squares of n values in float32: each square rounded, then added (torch's (x * x).sum / pow(2).mean
// order of operations; the additions in two lane-wise accumulators, so only their order differs from torch's).
namespace glm53 {
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  F16 acc0 = zero(), acc1 = zero();
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    const F16 a = load(x + i, kLanes), b = load(x + i + kLanes, kLanes);
    acc0 = acc0 + a * a;
    acc1 = acc1 + b * b;
  }
  for (; i < n; i += kLanes) {
    const F16 a = load(x + i, static_cast<int>(std::min<int64_t>(kLanes, n - i)));
    acc0 = acc0 + a * a;
  }
  return reduce_add(acc0 + acc1);
}

// 1 / (1 + exp(-x)) lane by lane, torch's sigmoid with vec.h's exp.
inline F16 sigmoid(F16 x) { return set1(1.0f) / (set1(1.0f) + exp(zero() - x)); }
}  // namespace glm53

// Runs the lambda with ``scalar_t`` bound to the C++ type of a float32 / bfloat16 / float16 tensor (the dtypes
// vec.h loads); anything else is an error naming ``what``.
#define GLM53_DISPATCH_FLOAT_TYPES(dtype, what, ...)                                              \
  [&] {                                                                                           \
    switch (dtype) {                                                                              \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }                          \
      case at::kBFloat16: { using scalar_t = c10::BFloat16; return __VA_ARGS__(); }               \
      case at::kHalf: { using scalar_t = c10::Half; return __VA_ARGS__(); }                       \
      default: TORCH_CHECK(false, what, ": unsupported dtype ", dtype);                           \
    }                                                                                             \
  }()
