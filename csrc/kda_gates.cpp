// The KDA layer's per-head gates and norms (the contract of vllm_glm53/backends/cpu/kda.py, whose *_torch
// functions are the references): the bounded forget gate, the L2 norms of q and k, and the gated output RMSNorm.
// In torch each is five to a dozen tensor ops whose dispatch, not arithmetic, is their cost in a decode step
// (about 150 us a KDA layer at batch 16 on one core of an Intel Xeon); here one pass over each head's values.
// The float32 steps are the references' own (true divisions and square roots, the same order of products), so
// the two differ only where squares are summed in another order and in the last bits of exp.

#include <vector>

#include "common.h"

namespace glm53 {
namespace {

// [T, H, d] with contiguous values per head, any token / head strides; anything else is copied.
at::Tensor heads_view(const at::Tensor& x, const char* what, const char* name) {
  TORCH_CHECK(x.dim() == 3, what, ": ", name, " must be [T, H, d], got ", x.sizes());
  return x.stride(2) == 1 ? x : x.contiguous();
}

}  // namespace

// a [T, H, d] (a = f_b(f_a(x)) + dt_bias), A_log [H] -> g [T, H, d] float32 = lower_bound * sigmoid(exp(A_log[h]) * a)
at::Tensor kda_gate(const at::Tensor& a_, const at::Tensor& A_log_, double lower_bound) {
  const char* what = "kda_gate";
  const at::Tensor a = heads_view(a_, what, "a");
  const int64_t T = a.size(0), H = a.size(1), d = a.size(2);
  TORCH_CHECK(A_log_.numel() == H, what, ": A_log must hold ", H, " values, got ", A_log_.sizes());
  const at::Tensor A_log = A_log_.contiguous();
  at::Tensor g = at::empty({T, H, d}, a.options().dtype(at::kFloat));
  const float bound = static_cast<float>(lower_bound);
  std::vector<float> rate(H);
  GLM53_DISPATCH_FLOAT_TYPES(A_log.scalar_type(), what, [&] {
    for (int64_t h = 0; h < H; ++h) rate[h] = std::exp(static_cast<float>(A_log.data_ptr<scalar_t>()[h]));
  });
  GLM53_DISPATCH_FLOAT_TYPES(a.scalar_type(), what, [&] {
    const scalar_t* ap = a.data_ptr<scalar_t>();
    float* gp = g.data_ptr<float>();
    at::parallel_for(0, T * H, token_grain(d), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t t = r / H, h = r % H;
        const scalar_t* at_ = ap + t * a.stride(0) + h * a.stride(1);
        const F16 rh = set1(rate[h]);
        for (int64_t i = 0; i < d; i += kLanes) {
          const int m = static_cast<int>(std::min<int64_t>(kLanes, d - i));
          store(gp + r * d + i, sigmoid(rh * load(at_ + i, m)) * set1(bound), m);
        }
      }
    });
  });
  return g;
}

// q, k [T, H, d] -> float32 (q / sqrt(|q|^2 + 1e-6) * scale, k / sqrt(|k|^2 + 1e-6)), each [T, H, d] contiguous.
std::tuple<at::Tensor, at::Tensor> kda_l2norm_qk(const at::Tensor& q_, const at::Tensor& k_, double scale_) {
  const char* what = "kda_l2norm_qk";
  const at::Tensor q = heads_view(q_, what, "q"), k = heads_view(k_, what, "k");
  TORCH_CHECK(q.sizes() == k.sizes(), what, ": q ", q.sizes(), " and k ", k.sizes(), " differ");
  const int64_t T = q.size(0), H = q.size(1), d = q.size(2);
  at::Tensor qo = at::empty({T, H, d}, q.options().dtype(at::kFloat));
  at::Tensor ko = at::empty({T, H, d}, k.options().dtype(at::kFloat));
  const float scale = static_cast<float>(scale_);
  const auto normalise = [&](const auto* x, float* out, bool scaled) {
    const F16 r = set1(std::sqrt(sum_squares(x, d) + 1e-6f));
    for (int64_t i = 0; i < d; i += kLanes) {
      const int m = static_cast<int>(std::min<int64_t>(kLanes, d - i));
      const F16 v = load(x + i, m) / r;
      store(out + i, scaled ? v * set1(scale) : v, m);
    }
  };
  GLM53_DISPATCH_FLOAT_TYPES(q.scalar_type(), what, [&] {
    using q_t = scalar_t;
    GLM53_DISPATCH_FLOAT_TYPES(k.scalar_type(), what, [&] {
      const q_t* qp = q.data_ptr<q_t>();
      const scalar_t* kp = k.data_ptr<scalar_t>();
      at::parallel_for(0, T * H, token_grain(2 * d), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t t = r / H, h = r % H;
          normalise(qp + t * q.stride(0) + h * q.stride(1), qo.data_ptr<float>() + r * d, true);
          normalise(kp + t * k.stride(0) + h * k.stride(1), ko.data_ptr<float>() + r * d, false);
        }
      });
    });
  });
  return {qo, ko};
}

// o [T, H, d], gate [T, H, d], weight [d] -> [T, H, d] out_dtype:
// o * rsqrt(mean(o^2) + eps) * weight * sigmoid(gate), all in float32.
at::Tensor kda_gated_rmsnorm(const at::Tensor& o_, const at::Tensor& gate_, const at::Tensor& weight_, double eps_,
                             at::ScalarType out_dtype) {
  const char* what = "kda_gated_rmsnorm";
  const at::Tensor o = heads_view(o_, what, "o"), gate = heads_view(gate_, what, "gate");
  TORCH_CHECK(o.sizes() == gate.sizes(), what, ": o ", o.sizes(), " and gate ", gate.sizes(), " differ");
  const int64_t T = o.size(0), H = o.size(1), d = o.size(2);
  TORCH_CHECK(weight_.dim() == 1 && weight_.size(0) == d, what, ": weight must be [", d, "], got ", weight_.sizes());
  // the weight widened here, not by a tensor op (it is in the model dtype, and this runs every step)
  std::vector<float> w(d);
  const at::Tensor weight = weight_.contiguous();
  GLM53_DISPATCH_FLOAT_TYPES(weight.scalar_type(), what, [&] {
    for (int64_t i = 0; i < d; ++i) w[i] = static_cast<float>(weight.data_ptr<scalar_t>()[i]);
  });
  at::Tensor out = at::empty({T, H, d}, o.options().dtype(out_dtype));
  const float eps = static_cast<float>(eps_);
  const float* wp = w.data();
  GLM53_DISPATCH_FLOAT_TYPES(o.scalar_type(), what, [&] {
    using o_t = scalar_t;
    GLM53_DISPATCH_FLOAT_TYPES(gate.scalar_type(), what, [&] {
      using g_t = scalar_t;
      GLM53_DISPATCH_FLOAT_TYPES(out_dtype, what, [&] {
        const o_t* op = o.data_ptr<o_t>();
        const g_t* gp = gate.data_ptr<g_t>();
        scalar_t* yp = out.data_ptr<scalar_t>();
        at::parallel_for(0, T * H, token_grain(2 * d), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t t = r / H, h = r % H;
            const o_t* ot = op + t * o.stride(0) + h * o.stride(1);
            const g_t* gt = gp + t * gate.stride(0) + h * gate.stride(1);
            const float mean = sum_squares(ot, d) / static_cast<float>(d);
            const F16 rs = set1(1.0f / std::sqrt(mean + eps));
            for (int64_t i = 0; i < d; i += kLanes) {
              const int m = static_cast<int>(std::min<int64_t>(kLanes, d - i));
              const F16 y = load(ot + i, m) * rs * load(wp + i, m) * sigmoid(load(gt + i, m));
              store(yp + r * d + i, y, m);
            }
          }
        });
      });
    });
  });
  return out;
}

}  // namespace glm53
