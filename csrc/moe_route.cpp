// GLM-5.3's MoE router on float32 logits (the contract of vllm_glm53/backends/cpu/moe.py, whose route_torch is the
// reference): sigmoid scores, the top-k experts by score + correction bias, the chosen experts' unbiased scores
// as weights (normalised to sum 1 if asked), times the routed scaling factor. In torch that is ten small tensor
// ops a MoE block and step, 17-30 us on one core at 1-16 tokens; here one pass per token. Group-limited routing
// (n_group > 1) is not done here: the checkpoint routes over one group, and the torch form keeps the general rule.
// The scores are the torch form's up to the last bits of exp; the sum of the k weights runs left to right.

#include <vector>

#include "common.h"

namespace glm53 {

// logits [T, E] float32, bias [E] float32 or none -> (weights [T, top_k] float32, ids [T, top_k] int64), each
// token's choices by descending biased score (ties: the lower expert id first).
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits_, const std::optional<at::Tensor>& bias_,
                                             int64_t top_k, bool renormalize, double scale) {
  const char* what = "moe_route";
  TORCH_CHECK(logits_.dim() == 2 && logits_.scalar_type() == at::kFloat, what,
              ": logits must be [T, E] float32, got ", logits_.sizes(), " ", logits_.scalar_type());
  const at::Tensor logits = logits_.contiguous();
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= E, what, ": top_k ", top_k, " must be in [1, ", E, "]");
  at::Tensor bias;
  if (bias_) {
    TORCH_CHECK(bias_->numel() == E && bias_->scalar_type() == at::kFloat, what, ": bias must hold ", E,
                " float32 values, got ", bias_->sizes(), " ", bias_->scalar_type());
    bias = bias_->contiguous();
  }
  at::Tensor weights = at::empty({T, top_k}, logits.options());
  at::Tensor ids = at::empty({T, top_k}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const float factor = static_cast<float>(scale);
  at::parallel_for(0, T, token_grain(E), [&](int64_t t0, int64_t t1) {
    std::vector<float> score(E);
    std::vector<float> best(top_k);
    std::vector<int64_t> best_id(top_k);
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = lp + t * E;
      for (int64_t e = 0; e < E; e += kLanes) {
        const int m = static_cast<int>(std::min<int64_t>(kLanes, E - e));
        store(score.data() + e, sigmoid(load(row + e, m)), m);
      }
      // top-k by insertion into a descending list; strict comparisons keep the lower id first on ties
      int64_t n = 0;
      for (int64_t e = 0; e < E; ++e) {
        const float c = bp ? score[e] + bp[e] : score[e];
        if (n == top_k && !(c > best[n - 1])) continue;
        int64_t j = n < top_k ? n++ : n - 1;
        for (; j > 0 && c > best[j - 1]; --j) {
          best[j] = best[j - 1];
          best_id[j] = best_id[j - 1];
        }
        best[j] = c;
        best_id[j] = e;
      }
      float* w = wp + t * top_k;
      float sum = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) {
        ip[t * top_k + j] = best_id[j];
        w[j] = score[best_id[j]];
        sum += w[j];
      }
      const float denominator = sum + 1e-20f;
      for (int64_t j = 0; j < top_k; ++j) w[j] = (renormalize ? w[j] / denominator : w[j]) * factor;
    }
  });
  return {weights, ids};
}

}  // namespace glm53
