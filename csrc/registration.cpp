// The torch custom ops of vllm_glm53's CPU kernels (namespace ``vllm_glm53``), CPU implementations only.
// Python reaches them as torch.ops.vllm_glm53.<name>; vllm_glm53/backends/cpu/kernels.py loads the library and
// the backends pick these ops when it loaded.

#include <torch/headeronly/version.h>
#include <torch/library.h>

#include <string>

#include "amx.h"
#include "common.h"

namespace glm53 {

at::Tensor kda_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, at::Tensor& pool, const at::Tensor& cu_seqlens,
                      const at::Tensor& state_in, const at::Tensor& state_out, const at::Tensor& state_out_at);
at::Tensor causal_conv1d_varlen(const at::Tensor& x, const at::Tensor& weight, at::Tensor& pool,
                                const at::Tensor& cu_seqlens, const at::Tensor& state_in,
                                const at::Tensor& state_out, const at::Tensor& state_out_at);
at::Tensor kda_gate(const at::Tensor& a, const at::Tensor& A_log, double lower_bound);
std::tuple<at::Tensor, at::Tensor> kda_l2norm_qk(const at::Tensor& q, const at::Tensor& k, double scale);
at::Tensor kda_gated_rmsnorm(const at::Tensor& o, const at::Tensor& gate, const at::Tensor& weight, double eps,
                             at::ScalarType out_dtype);
at::Tensor kpool_compress(const at::Tensor& k, const at::Tensor& gate, const at::Tensor& ape);
at::Tensor index_scores(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& pooled);
at::Tensor select_tokens(const std::optional<at::Tensor>& scores, const at::Tensor& positions, int64_t topk,
                         int64_t kp, bool always_select_tail);
void store_pooled_keys(at::Tensor& pooled, const at::Tensor& raw, const at::Tensor& key_gate,
                       const at::Tensor& slot_mapping, const at::Tensor& ape);
at::Tensor indexer_select(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& pooled,
                          const at::Tensor& block_table, const at::Tensor& query_start_loc,
                          const at::Tensor& seq_lens, int64_t topk, int64_t kp, bool always_select_tail);
at::Tensor sparse_latent_attention(const at::Tensor& q_lat, const at::Tensor& rows, const at::Tensor& block_table,
                                   const at::Tensor& query_start_loc, const at::Tensor& indices, double scale,
                                   int64_t latent_dim);
at::Tensor head_products(const at::Tensor& x, const at::Tensor& tiles, int64_t N);
void write_tokens(at::Tensor& latent_pages, at::Tensor& raw, const at::Tensor& slot_mapping, const at::Tensor& latent,
                  const std::optional<at::Tensor>& key_gate);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor mhc_mix(const at::Tensor& X, const at::Tensor& fn, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> mhc_coefficients(const at::Tensor& m, const at::Tensor& base,
                                                                const at::Tensor& scale, int64_t n, double eps,
                                                                int64_t sinkhorn_iters);
at::Tensor mhc_collapse(const at::Tensor& X, const at::Tensor& pre);
at::Tensor mhc_expand(const at::Tensor& X, const at::Tensor& y, const at::Tensor& post, const at::Tensor& comb);
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, const std::optional<at::Tensor>& bias,
                                             int64_t top_k, bool renormalize, double scale);
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& ids,
                       const at::Tensor& weights, double swiglu_limit);
at::Tensor moe_experts_fp8(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w13_scale,
                           const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& ids,
                           const at::Tensor& weights, double swiglu_limit, int64_t block_n, int64_t block_k);
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, at::IntArrayRef parts,
                      int64_t block_n, int64_t block_k);
at::Tensor linear16(const at::Tensor& x, const at::Tensor& weight);
void fp8_dequantize(const at::Tensor& weight, const at::Tensor& scale, at::IntArrayRef parts, int64_t block_n,
                    int64_t block_k, at::Tensor& out);

// Whether the kernels multiply on AMX tiles (amx.h); ``enable`` turns them on (where the CPU has them) or off.
bool amx_tiles_op(std::optional<bool> enable) { return enable ? set_amx_tiles(*enable) : amx_tiles(); }

// "<isa> torch <version>": what this library was built for, checked by the loader and shown in its log line.
std::string build_info() {
  std::string info = std::string(isa_name()) + " torch " + TORCH_VERSION;
#if GLM53_AVX512
  if (has_bf16_dot()) info += ", bfloat16 dot products";
#endif
  if (amx_tiles()) info += ", AMX tiles";
  return info;
}

}  // namespace glm53

TORCH_LIBRARY(vllm_glm53, m) {
  m.def("build_info() -> str", &glm53::build_info);
  m.def("amx_tiles(bool? enable=None) -> bool", &glm53::amx_tiles_op);
  m.def("kda_varlen(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) pool, Tensor cu_seqlens,"
        " Tensor state_in, Tensor state_out, Tensor state_out_at) -> Tensor");
  m.def("causal_conv1d_varlen(Tensor x, Tensor weight, Tensor(a!) pool, Tensor cu_seqlens, Tensor state_in,"
        " Tensor state_out, Tensor state_out_at) -> Tensor");
  m.def("kda_gate(Tensor a, Tensor A_log, float lower_bound) -> Tensor");
  m.def("kda_l2norm_qk(Tensor q, Tensor k, float scale) -> (Tensor, Tensor)");
  m.def("kda_gated_rmsnorm(Tensor o, Tensor gate, Tensor weight, float eps, ScalarType out_dtype) -> Tensor");
  m.def("kpool_compress(Tensor k, Tensor gate, Tensor ape) -> Tensor");
  m.def("index_scores(Tensor q, Tensor weights, Tensor pooled) -> Tensor");
  m.def("select_tokens(Tensor? scores, Tensor positions, int topk, int kp, bool always_select_tail) -> Tensor");
  m.def("store_pooled_keys(Tensor(a!) pooled, Tensor raw, Tensor key_gate, Tensor slot_mapping, Tensor ape) -> ()");
  m.def("indexer_select(Tensor q, Tensor weights, Tensor pooled, Tensor block_table, Tensor query_start_loc,"
        " Tensor seq_lens, int topk, int kp, bool always_select_tail) -> Tensor");
  m.def("sparse_latent_attention(Tensor q_lat, Tensor rows, Tensor block_table, Tensor query_start_loc,"
        " Tensor indices, float scale, int latent_dim) -> Tensor");
  m.def("head_products(Tensor x, Tensor tiles, int N) -> Tensor");
  m.def("write_tokens(Tensor(a!) latent_pages, Tensor(b!) raw, Tensor slot_mapping, Tensor latent, Tensor? key_gate)"
        " -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("mhc_mix(Tensor X, Tensor fn, float eps) -> Tensor");
  m.def("mhc_coefficients(Tensor m, Tensor base, Tensor scale, int n, float eps, int sinkhorn_iters)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("mhc_collapse(Tensor X, Tensor pre) -> Tensor");
  m.def("mhc_expand(Tensor X, Tensor y, Tensor post, Tensor comb) -> Tensor");
  m.def("moe_route(Tensor logits, Tensor? bias, int top_k, bool renormalize, float scale) -> (Tensor, Tensor)");
  m.def("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor ids, Tensor weights, float swiglu_limit) -> Tensor");
  m.def("moe_experts_fp8(Tensor x, Tensor w13, Tensor w13_scale, Tensor w2, Tensor w2_scale, Tensor ids,"
        " Tensor weights, float swiglu_limit, int block_n, int block_k) -> Tensor");
  m.def("fp8_linear(Tensor x, Tensor weight, Tensor scale, int[] parts, int block_n, int block_k) -> Tensor");
  m.def("linear16(Tensor x, Tensor weight) -> Tensor");
  m.def("fp8_dequantize(Tensor weight, Tensor scale, int[] parts, int block_n, int block_k, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_glm53, CPU, m) {
  m.impl("kda_varlen", &glm53::kda_varlen);
  m.impl("causal_conv1d_varlen", &glm53::causal_conv1d_varlen);
  m.impl("kda_gate", &glm53::kda_gate);
  m.impl("kda_l2norm_qk", &glm53::kda_l2norm_qk);
  m.impl("kda_gated_rmsnorm", &glm53::kda_gated_rmsnorm);
  m.impl("kpool_compress", &glm53::kpool_compress);
  m.impl("index_scores", &glm53::index_scores);
  m.impl("select_tokens", &glm53::select_tokens);
  m.impl("store_pooled_keys", &glm53::store_pooled_keys);
  m.impl("indexer_select", &glm53::indexer_select);
  m.impl("sparse_latent_attention", &glm53::sparse_latent_attention);
  m.impl("head_products", &glm53::head_products);
  m.impl("write_tokens", &glm53::write_tokens);
  m.impl("rms_norm", &glm53::rms_norm);
  m.impl("mhc_mix", &glm53::mhc_mix);
  m.impl("mhc_coefficients", &glm53::mhc_coefficients);
  m.impl("mhc_collapse", &glm53::mhc_collapse);
  m.impl("mhc_expand", &glm53::mhc_expand);
  m.impl("moe_route", &glm53::moe_route);
  m.impl("moe_experts", &glm53::moe_experts);
  m.impl("moe_experts_fp8", &glm53::moe_experts_fp8);
  m.impl("fp8_linear", &glm53::fp8_linear);
  m.impl("linear16", &glm53::linear16);
  m.impl("fp8_dequantize", &glm53::fp8_dequantize);
}
