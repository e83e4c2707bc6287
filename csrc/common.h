// What every kernel file shares besides vec.h: the dtype dispatch for cache rows and activations.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

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

// An int32 or int64 index tensor of at most two dimensions (a plan's block table, query starts and lengths,
// selected positions; any strides) read where it lies. torch's conversion to int64 (``.to(at::kLong)``) is a
// dispatched op and a fresh allocation per call: on a cold decode step each such op cost the indexer ~20-30 us
// (benchmarks/README.md). ``op`` and ``what`` name the op and the argument in the error.
struct IndexView {
  const void* data;
  bool wide;  // int64
  int64_t s0, s1;
  IndexView(const at::Tensor& t, const char* op, const char* what)
      : data(t.data_ptr()), wide(t.scalar_type() == at::kLong), s0(t.dim() >= 1 ? t.stride(0) : 0),
        s1(t.dim() == 2 ? t.stride(1) : 0) {
    TORCH_CHECK(t.scalar_type() == at::kInt || wide, op, ": ", what, " must be int32 or int64, got ",
                t.scalar_type());
    TORCH_CHECK(t.dim() >= 1 && t.dim() <= 2, op, ": ", what, " must have 1 or 2 dimensions, got ", t.dim());
  }
  int64_t operator()(int64_t i, int64_t j = 0) const {
    const int64_t at = i * s0 + j * s1;
    return wide ? static_cast<const int64_t*>(data)[at] : static_cast<const int32_t*>(data)[at];
  }
};

// A 1-D index tensor's values (one per request or token: small).
inline std::vector<int64_t> index_values(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.dim() == 1, op, ": ", what, " must be 1-D");
  const IndexView view(t, op, what);
  std::vector<int64_t> v(t.size(0));
  for (int64_t i = 0; i < t.size(0); ++i) v[i] = view(i);
  return v;
}

// A step plan's query starts and block table, checked as every op reading the plan needs them: query_start_loc
// holds n_req + 1 offsets, ascending from 0 or more, the last exactly T (``every_query``: each query belongs to a
// request) or at most T; the block table (2-D, checked by the caller) has a row for each request. Returns the
// offsets.
inline std::vector<int64_t> query_starts(const at::Tensor& query_start_loc, int64_t n_req, int64_t T,
                                         bool every_query, const at::Tensor& block_table, const char* op) {
  std::vector<int64_t> qs = index_values(query_start_loc, op, "query_start_loc");
  TORCH_CHECK(static_cast<int64_t>(qs.size()) == n_req + 1, op, ": query_start_loc holds ", qs.size(),
              " offsets for ", n_req, " requests");
  for (int64_t r = 0; r < n_req; ++r)
    TORCH_CHECK(qs[r] >= 0 && qs[r] <= qs[r + 1], op, ": query_start_loc must ascend from 0, got ", qs[r], " then ",
                qs[r + 1]);
  TORCH_CHECK(every_query ? qs[n_req] == T : qs[n_req] <= T, op, ": query_start_loc ends at ", qs[n_req],
              every_query ? ", not " : ", past ", T);
  TORCH_CHECK(block_table.size(0) >= n_req, op, ": ", n_req, " requests but ", block_table.size(0),
              " block-table rows");
  return qs;
}
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
