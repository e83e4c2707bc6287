// RMSNorm with transformers' rounding on CPU (the contract of vllm_glm53/backends/cpu/norm.py, whose
// rms_norm_torch is the reference):
//
//   out = weight * to_dtype(x * rsqrt(mean(x^2) + eps))
//
// The statistic in float32, the normalised value rounded to x's dtype before the weight multiplies it, and that
// product rounded to the dtype again (torch's 16-bit multiply computes in float32 and rounds once). Every step is
// the reference's own float32 operation (squares, then sums; a true division and square root), so the two differ
// only where the squares are summed in another order: a few ulp of the statistic, and none when the sums are
// exact. One pass per row instead of the reference's six tensor ops, whose dispatch, not arithmetic, was the cost
// of a decode step's norms (about 13 us a call on the development machine).

#include <type_traits>

#include "common.h"

namespace glm53 {
namespace {

// v rounded to T's precision and widened again (nothing for float32), as the reference's .to(x.dtype).
template <typename T>
inline F16 round_as(F16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T tmp[kLanes];
    store(tmp, v, kLanes);
    return load(static_cast<const T*>(tmp), kLanes);  // with n: a one-argument load is also c10's
  }
}

}  // namespace

// x [..., D] (float32 / bf16 / fp16), weight [D] of x's dtype -> x's shape and dtype.
at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& weight_, double eps_) {
  TORCH_CHECK(x_.dim() >= 1 && x_.size(-1) > 0, "rms_norm: x needs a non-empty last dimension, got ", x_.sizes());
  const int64_t D = x_.size(-1);
  TORCH_CHECK(weight_.dim() == 1 && weight_.size(0) == D, "rms_norm: weight must be [", D, "], got ",
              weight_.sizes());
  TORCH_CHECK(weight_.scalar_type() == x_.scalar_type(), "rms_norm: weight is ", weight_.scalar_type(), ", x ",
              x_.scalar_type());
  // Rows with contiguous values at any row stride (a column slice); anything else is copied first.
  const at::Tensor x = x_.dim() == 2 && x_.stride(1) == 1 ? x_ : x_.contiguous().view({-1, D});
  const at::Tensor weight = weight_.contiguous();
  const int64_t T = x.size(0), xs = x.stride(0);
  at::Tensor out = at::empty({T, D}, x.options());
  const float eps = static_cast<float>(eps_);
  GLM53_DISPATCH_FLOAT_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, token_grain(D), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* xt = xp + t * xs;
        scalar_t* ot = op + t * D;
        const float mean = sum_squares(xt, D) / static_cast<float>(D);
        const F16 r = set1(1.0f / std::sqrt(mean + eps));
        for (int64_t d = 0; d < D; d += kLanes) {
          const int w = static_cast<int>(std::min<int64_t>(kLanes, D - d));
          store(ot + d, load(wp + d, w) * round_as<scalar_t>(load(xt + d, w) * r), w);
        }
      }
    });
  });
  return out.view(x_.sizes());
}

}  // namespace glm53
