// Linear layers whose block-FP8 weights stay in memory as E4M3 bytes (vllm_glm53/backends/cpu/fp8.py, whose
// fp8_linear_torch is the reference: dequantize, then multiply):
//
//   out[m, n] = sum_k x[m, k] * float(w[n, k]) * scale[block row of n, k / bk]
//
// A weight may be several checkpoint tensors fused along the rows (gate | up, q | k | v), each with its own
// block grid and ragged last block: ``parts`` gives their row counts, and part p's scale rows start at
// ceil(row offset of p / bn), where vLLM's fused-parameter loaders put them.
//
// Tasks are kRowsPerTask rows inside one row block of one part, one parallel region over them. With at most
// kDirectMaxTokens tokens (decode) the direct path streams every weight byte once, converting it in registers;
// with more (prefill) the tile path dequantizes each row pair once per token chunk into an L1-resident buffer
// and dots it with every token of the chunk (gemv.h).

#include <vector>

#include "gemv.h"

namespace glm53 {
namespace {

struct RowTask {
  int64_t row0, rows, scale_row;
};

// Every part's row blocks, split into tasks of kRowsPerTask rows (a row block is a multiple of them).
std::vector<RowTask> row_tasks(const std::vector<int64_t>& parts, int64_t block_n) {
  std::vector<RowTask> tasks;
  int64_t offset = 0;
  for (const int64_t n : parts) {
    const int64_t first_scale_row = ceil_div(offset, block_n);
    for (int64_t r = 0; r < n; r += kRowsPerTask)
      tasks.push_back({offset + r, std::min(kRowsPerTask, n - r), first_scale_row + r / block_n});
    offset += n;
  }
  return tasks;
}

}  // namespace

// x [M, K] float32 / bf16 / fp16, weight [N, K] float8_e4m3fn, scale [S, ceil(K / bk)] float32 (S: the last
// part's first scale row plus its row blocks), parts: row counts summing to N -> out [M, N] in x's dtype.
at::Tensor fp8_linear(const at::Tensor& x_, const at::Tensor& weight_, const at::Tensor& scale_,
                      at::IntArrayRef parts_, int64_t block_n, int64_t block_k) {
  const char* what = "fp8_linear";
  TORCH_CHECK(x_.dim() == 2 && weight_.dim() == 2 && scale_.dim() == 2, what, ": x [M, K], weight [N, K], scale 2-D");
  TORCH_CHECK(weight_.scalar_type() == at::kFloat8_e4m3fn, what, ": weight must be float8_e4m3fn");
  TORCH_CHECK(scale_.scalar_type() == at::kFloat, what, ": scale must be float32");
  for (const at::Tensor* t : {&x_, &weight_, &scale_})
    TORCH_CHECK(t->device().is_cpu(), what, ": tensors must be on the CPU");
  check_fp8_blocks(what, block_n, block_k);
  const int64_t M = x_.size(0), K = x_.size(1), N = weight_.size(0), KB = ceil_div(K, block_k);
  TORCH_CHECK(weight_.size(1) == K, what, ": weight has ", weight_.size(1), " columns for ", K, " inputs");
  std::vector<int64_t> parts(parts_.begin(), parts_.end());
  int64_t total = 0;
  for (const int64_t n : parts) {
    TORCH_CHECK(n > 0, what, ": part sizes must be positive, got ", parts_);
    total += n;
  }
  TORCH_CHECK(total == N, what, ": parts ", parts_, " do not add up to the weight's ", N, " rows");
  const int64_t scale_rows = ceil_div(N - parts.back(), block_n) + ceil_div(parts.back(), block_n);
  TORCH_CHECK(scale_.size(0) == scale_rows && scale_.size(1) == KB, what, ": scale must be [", scale_rows, ", ",
              KB, "] for parts ", parts_, " and blocks [", block_n, ", ", block_k, "], got ", scale_.sizes());
  at::Tensor out = at::empty({M, N}, x_.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const at::Tensor x = x_.to(at::kFloat).contiguous();
  const at::Tensor w = weight_.stride(1) == 1 ? weight_ : weight_.contiguous();
  const at::Tensor scale = scale_.contiguous();
  const float* xp = x.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const E4m3* wp = reinterpret_cast<const E4m3*>(w.data_ptr());
  const int64_t ws = w.stride(0);
  const std::vector<RowTask> tasks = row_tasks(parts, block_n);

  GLM53_DISPATCH_FLOAT_TYPES(x_.scalar_type(), what, [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    if (M <= kDirectMaxTokens) {
      at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t end) {
        std::vector<float> xs_buf(M * K);
        const float* xs[kDirectMaxTokens];
        for (int64_t j = 0; j < M; ++j) xs[j] = xs_buf.data() + j * K;
        float acc[2][kDirectMaxTokens];
        int64_t scaled_for = -1;  // consecutive tasks of a thread mostly share a row block: scale the tokens once
        for (; b < end; ++b) {
          const RowTask& task = tasks[b];
          if (task.scale_row != scaled_for) {
            for (int64_t j = 0; j < M; ++j)
              scale_by_blocks(xp + j * K, sp + task.scale_row * KB, K, block_k, xs_buf.data() + j * K);
            scaled_for = task.scale_row;
          }
          const int64_t last = task.row0 + task.rows;
          for (int64_t r = task.row0; r < last; r += 2) {
            const int nr = static_cast<int>(std::min<int64_t>(2, last - r));
            const E4m3* rows[2] = {wp + r * ws, wp + (r + nr - 1) * ws};
            const int64_t rn = std::min(r + 2 * kAhead, N - 2);
            const E4m3* next[2] = {wp + rn * ws, wp + (rn + 1) * ws};
            dot_rows(rows, rn >= 0 ? next : nullptr, nr, xs, static_cast<int>(M), K, acc);
            for (int64_t j = 0; j < M; ++j)
              for (int i = 0; i < nr; ++i) op[j * N + r + i] = static_cast<scalar_t>(acc[i][j]);
          }
        }
      });
      return;
    }
    const int64_t chunk = token_chunk(K, kTileChunkBytes);
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t end) {
      std::vector<float> tile(2 * K);
      const float* rows[2] = {tile.data(), tile.data() + K};
      const float* xs[kTok];
      float acc[2][kTok];
      for (; b < end; ++b) {
        const RowTask& task = tasks[b];
        const float* scale_row = sp + task.scale_row * KB;
        const int64_t last = task.row0 + task.rows;
        for (int64_t t0 = 0; t0 < M; t0 += chunk) {
          const int64_t t1 = std::min(t0 + chunk, M);
          for (int64_t r = task.row0; r < last; r += 2) {
            const int nr = static_cast<int>(std::min<int64_t>(2, last - r));
            for (int i = 0; i < nr; ++i) dequantize_row(wp + (r + i) * ws, scale_row, K, block_k, tile.data() + i * K);
            for (int64_t j0 = t0; j0 < t1; j0 += kTok) {
              const int n = static_cast<int>(std::min<int64_t>(kTok, t1 - j0));
              for (int j = 0; j < n; ++j) xs[j] = xp + (j0 + j) * K;
              if (nr == 2) dot_tokens<2>(rows, nullptr, xs, n, K, acc);
              else dot_tokens<1>(rows, nullptr, xs, n, K, acc);
              for (int j = 0; j < n; ++j)
                for (int i = 0; i < nr; ++i) op[(j0 + j) * N + r + i] = static_cast<scalar_t>(acc[i][j]);
            }
          }
        }
      }
    });
  });
  return out;
}

}  // namespace glm53
