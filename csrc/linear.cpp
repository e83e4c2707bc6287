// Linear layers whose weights the CPU does not multiply natively, kept in memory as they are loaded
// (vllm_glm53/backends/cpu/linear.py and fp8.py hold the references: widen or dequantize, then multiply):
//
//   linear16    out[m, n] = sum_k x[m, k] * float(w[n, k])                                 w bfloat16 / float16
//   fp8_linear  out[m, n] = sum_k x[m, k] * float(w[n, k]) * scale[block row of n, k / bk]  w float8_e4m3fn
//
// A block-FP8 weight may be several checkpoint tensors fused along the rows (gate | up, q | k | v), each with its
// own block grid and ragged last block: ``parts`` gives their row counts, and part p's scale rows start at
// ceil(row offset of p / bn), where vLLM's fused-parameter loaders put them.
//
// Rows go in tasks of kRowsPerTask rows inside one row block of one part. Three paths, by the number of tokens M:
//   direct  (M <= kDirectMaxTokens, kE4m3DirectMaxTokens for FP8, kPairsDirectMaxTokens for FP8 rows and bfloat16
//           tokens on bfloat16 dot products; decode): one parallel region over the tasks streams every weight byte
//           once, converting it in registers (gemv.h), so the call is bound by reading the weight;
//   tile    (up to kPanelMinTokens, decode batches): the tokens lie across the vector lanes (transposed once) and
//           kRowTile rows at a time, widened / dequantized a chunk of columns at a time into an L1-resident float32
//           buffer, are broadcast against them (gemv.h's rows_by_tokens: no horizontal sums, one token load per
//           column for all the rows); FP8 rows and bfloat16 tokens on a CPU with bfloat16 dot products: E4M3 values
//           as bfloat16 against token pairs (rows_by_token_pairs), 1.3-1.5x faster from 16 to 128 tokens; on AMX
//           tiles where the CPU has them (amx.h), from 3 tokens (6 for rows under 4,096 columns: pairs_direct_max),
//           3.3x the pairs' speed at 16;
//   panels  (more tokens: prefill): consecutive tasks make a panel of about kPanelBytes of
//           float32 rows; all threads widen / dequantize the panel into a buffer, then torch's float32 GEMM
//           multiplies it with the tokens into the panel's output columns. The conversion is paid once per weight
//           element and call, and the products run at the float32 GEMM's rate: on an AVX2 machine (no native
//           bf16) torch's bfloat16 GEMM ran at ~15 GFLOP/s on 2 cores where its float32 GEMM ran at ~90 and a
//           row-pair tile loop (gemv.h's dot products over a dequantized row) at ~40.

#include <vector>

#include "gemv.h"

namespace glm53 {
namespace {

// Float32 weight rows per panel: large enough that the GEMM runs at its full rate and the token rows are re-read
// only N * K * 4 / kPanelBytes times, small enough to stay in the last-level cache between the two steps.
constexpr int64_t kPanelBytes = 4 << 20;
// Tokens from which the panels take over from the tile path. 4096 x 4096, cold, AVX2, 2 threads: the tile path
// ran 86-109 GFLOP/s from 32 to 256 tokens, the panels 42-54 at 32-64 tokens, 66-100 at 96-128 and 86-98 at 256
// (~110 at 512). The portable build's tile path has SSE2's registers (kRowTile 2): it keeps the earlier switch,
// which was measured against the dot-product tile loop (M = 16 1.5x slower through panels, M = 64 2x faster).
constexpr int64_t kPanelMinTokens = kVectorRegs >= 8 ? 256 : 32;

struct RowTask {
  int64_t row0, rows, scale_row;
};

// Every part's row blocks, split into tasks of kRowsPerTask rows (a row block is a multiple of them). Without
// blocks (16-bit weights) block_n is the weight's row count rounded up to kRowsPerTask.
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

// 16-bit weight rows: read as they are (vec.h widens bfloat16 / float16 lanes to float32).
template <typename W_>
struct Rows16 {
  using W = W_;
  static constexpr bool kScaledTokens = false;  // the direct path dots the float32 tokens as they are
  static constexpr int64_t kDirectMax = kDirectMaxTokens;
  const W* w;
  int64_t ws;
  int64_t column_block() const { return kLanes; }  // widen()'s column ranges start at multiples of this
  const W* row(int64_t r) const { return w + r * ws; }
  // Row r's columns [k0, k0 + n) as float32.
  void widen(const RowTask&, int64_t r, int64_t k0, int64_t n, float* out) const { to_float(row(r) + k0, out, n); }
};

// Block-FP8 rows: direct-path tokens are pre-multiplied by the task's row-block scales (scale_by_blocks), panel
// rows are dequantized bit for bit as the reference does (dequantize_row).
struct RowsFp8 {
  using W = E4m3;
  static constexpr bool kScaledTokens = true;
  static constexpr int64_t kDirectMax = kE4m3DirectMaxTokens;
  const E4m3* w;
  int64_t ws;
  const float* scale;
  int64_t KB, block_k;
  void scale_tokens(const RowTask& task, const float* x, int64_t M, int64_t K, float* buf) const {
    for (int64_t j = 0; j < M; ++j)
      scale_by_blocks(x + j * K, scale + task.scale_row * KB, K, block_k, buf + j * direct_len(K));
  }
  int64_t column_block() const { return block_k; }
  const float* scale_row(const RowTask& task) const { return scale + task.scale_row * KB; }
  const E4m3* row(int64_t r) const { return w + r * ws; }
  // Row r's columns [k0, k0 + n) dequantized (k0 a multiple of block_k), into float32 or a 16-bit type.
  template <typename T>
  void widen(const RowTask& task, int64_t r, int64_t k0, int64_t n, T* out) const {
    dequantize_row(row(r) + k0, scale + task.scale_row * KB + k0 / block_k, n, block_k, out);
  }
};

// out [M, N] (x's dtype) = x [M, K] (float32, contiguous) times the weight ``rows`` describe, tasks covering its
// N rows in order.
template <typename Rows>
void run_linear(const at::Tensor& x, const std::vector<RowTask>& tasks, const Rows& rows, at::Tensor& out) {
  using W = typename Rows::W;
  constexpr bool scaled_tokens = Rows::kScaledTokens;
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const float* xp = x.data_ptr<float>();
  if (M >= kPanelMinTokens) {
    at::Tensor out32 = out.scalar_type() == at::kFloat ? out : at::empty({M, N}, x.options());
    const int64_t target = std::max<int64_t>(kRowsPerTask, kPanelBytes / (4 * K));
    at::Tensor panel = at::empty({std::min(N, target + kRowsPerTask), K}, x.options());
    float* pp = panel.data_ptr<float>();
    for (size_t t0 = 0; t0 < tasks.size();) {
      size_t t1 = t0;
      int64_t n = 0;
      while (t1 < tasks.size() && n < target) n += tasks[t1++].rows;
      const int64_t row0 = tasks[t0].row0;
      at::parallel_for(static_cast<int64_t>(t0), static_cast<int64_t>(t1), 1, [&](int64_t b, int64_t end) {
        for (; b < end; ++b)
          for (int64_t r = tasks[b].row0; r < tasks[b].row0 + tasks[b].rows; ++r)
            rows.widen(tasks[b], r, 0, K, pp + (r - row0) * K);
      });
      at::Tensor dst = out32.narrow(1, row0, n);
      at::mm_out(dst, x, panel.narrow(0, 0, n).t());
      t0 = t1;
    }
    if (!out32.is_same(out)) out.copy_(out32);
    return;
  }
  GLM53_DISPATCH_FLOAT_TYPES(out.scalar_type(), "linear output", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    // Block-FP8 rows and bfloat16 tokens on a CPU with bfloat16 dot products: the direct path takes them as they
    // are (in unpack order), against the E4M3 values as bfloat16 (gemv.h's dot_task_pairs), up to
    // kPairsDirectMaxTokens tokens.
    constexpr bool kMayPair = std::is_same_v<W, E4m3> && std::is_same_v<scalar_t, c10::BFloat16>;
    const bool direct_pairs = kMayPair && bf16_pairs(at::kBFloat16, K);
    if (M > (direct_pairs ? pairs_direct_max(amx_tiles(), K) : Rows::kDirectMax)) {
      const int64_t groups = ceil_div(M, kLanes);
      // Every task's rows, kRowTile at a time, against all token groups xt, ``chunk`` columns at a time; widen(task,
      // r, k0, n, out) writes row r's columns [k0, k0 + n) into a Tile-typed buffer, block_scales(task) is what
      // row_tile_by_tokens takes.
      const auto row_tiles = [&]<typename Tile, typename Tokens>(const Tokens* xt, int64_t chunk, const auto& widen,
                                                                 const auto& block_scales) {
        at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t end) {
          const TileBuffer<Tile> tile(kTileBlocks<Tile> * kRowTile * tile_stride<Tile>(chunk));
          std::vector<float> acc(groups * kRowTile * kLanes);
          for (; b < end; ++b) {
            const RowTask& task = tasks[b];
            const int64_t last = task.row0 + task.rows;
            for (int64_t r0 = task.row0; r0 < last; r0 += kRowTile) {
              const int nr = static_cast<int>(std::min<int64_t>(kRowTile, last - r0));
              // prefetched after these rows: the task's next rows (the next task's first rows are not requested)
              const int nn = static_cast<int>(std::clamp<int64_t>(last - r0 - kRowTile, 0, kRowTile));
              const char* here[kRowTile];
              const char* next[kRowTile];
              for (int i = 0; i < nr; ++i) here[i] = reinterpret_cast<const char*>(rows.row(r0 + i));
              for (int i = 0; i < nn; ++i) next[i] = reinterpret_cast<const char*>(rows.row(r0 + kRowTile + i));
              row_tile_by_tokens(
                  nr, [&](int i, int64_t k0, int64_t n, Tile* out) { widen(task, r0 + i, k0, n, out); }, here, next,
                  nn, sizeof(W), xt, block_scales(task), groups, K, chunk, tile.data(), acc.data());
              for (int64_t g = 0; g < groups; ++g)
                store_tile_columns(reinterpret_cast<const float(*)[kLanes]>(acc.data() + g * kRowTile * kLanes), nr,
                                   std::min<int64_t>(kLanes, M - g * kLanes), op + g * kLanes * N + r0, N);
            }
          }
        });
      };
#if GLM53_AVX512
      // Block-FP8 rows and bfloat16 tokens on a CPU with bfloat16 dot products: the rows' E4M3 values as bfloat16
      // against token pairs, one column block per chunk, both in unpack order (gemv.h), twice the products per
      // instruction.
      if constexpr (std::is_same_v<W, E4m3> && std::is_same_v<scalar_t, c10::BFloat16>) {
        if (bf16_pairs(at::kBFloat16, K)) {
          const UnpackOrder order(K, rows.column_block());
          const at::Tensor xp_buf = at::empty({groups * order.len / 2 * kLanes}, x.options().dtype(at::kInt));
          uint32_t* xp2 = reinterpret_cast<uint32_t*>(xp_buf.data_ptr<int32_t>());
          token_pairs_across_lanes([&](int64_t j) { return xp + j * K; }, M, order, order.positions().data(), xp2);
          row_tiles.template operator()<c10::BFloat16>(
              static_cast<const uint32_t*>(xp2), rows.column_block(),
              [&](const RowTask&, int64_t r, int64_t k0, int64_t n, c10::BFloat16* out) {
                e4m3_unpacked(rows.row(r) + k0, n, out);
              },
              [&](const RowTask& task) { return rows.scale_row(task); });
          return;
        }
      }
#endif
      const at::Tensor xt_buf = at::empty({groups * K * kLanes}, x.options());  // every value written below
      float* xt = xt_buf.data_ptr<float>();
      tokens_across_lanes([&](int64_t j) { return xp + j * K; }, M, K, xt);
      row_tiles.template operator()<float>(
          static_cast<const float*>(xt), ceil_div(kColumnChunk, rows.column_block()) * rows.column_block(),
          [&](const RowTask& task, int64_t r, int64_t k0, int64_t n, float* out) { rows.widen(task, r, k0, n, out); },
          [](const RowTask&) -> const float* { return nullptr; });
      return;
    }
    const int64_t ahead = rows_ahead(K * static_cast<int64_t>(sizeof(W)));  // rows on, in the stream of rows
    // Block-FP8 rows (fp8: rows, as RowsFp8), a task a call: make_dot() gives each thread a dot(task, task rows,
    // out) that fills out[0][j] with the task's sums against token j (gemv.h's task_quads, dot_task_pairs and
    // dot_task_rows), stored a vector per token.
    const auto task_calls = [&](const auto& fp8, const auto& make_dot) {
      at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t end) {
        auto dot = make_dot();
        alignas(64) float sums[std::max(kPairsDirectMaxTokens, kE4m3DirectMaxTokens)][kLanes];
        float(*const out[2])[kLanes] = {sums, nullptr};
        for (; b < end; ++b) {
          const RowTask& task = tasks[b];
          dot(task,
              TaskRows{{fp8.row(task.row0), nullptr}, {fp8.scale_row(task), nullptr}, 1, fp8.ws, task.rows, ahead,
                       N - task.row0},
              out);
          for (int64_t j = 0; j < M; ++j) store(op + j * N + task.row0, load(sums[j]), static_cast<int>(task.rows));
        }
      });
    };
#if GLM53_AVX512
    // Block-FP8 rows and bfloat16 tokens on a CPU with bfloat16 dot products: the tokens as they are (in unpack
    // order), against the E4M3 values as bfloat16, each column block's sums times its scale (gemv.h's
    // dot_task_pairs). 12288 x 4096, Zen 4, 2 threads: 1.7-1.8x faster at 4 and 8 tokens than the float32 path.
    if constexpr (kMayPair) {
      if (direct_pairs) {
        const UnpackOrder order(K, rows.column_block());
        const at::Tensor xb = at::zeros({M, order.len}, x.options().dtype(at::kBFloat16));
        const c10::BFloat16* xs[kPairsDirectMaxTokens];
        for (int64_t j = 0; j < M; ++j) {
          order.put(xp + j * K, xb.data_ptr<c10::BFloat16>() + j * order.len);  // exact: the tokens were bfloat16
          xs[j] = xb.data_ptr<c10::BFloat16>() + j * order.len;
        }
        task_calls(rows, [&] {
          return [&](const RowTask&, const TaskRows& task_rows, float (*const* out)[kLanes]) {
            dot_task_pairs(task_rows, xs, static_cast<int>(M), K, rows.column_block(), out);
          };
        });
        return;
      }
    }
#endif
#if GLM53_AVX2
    // Block-FP8 rows against one token: the token in quad order, each column block's sums times its scale
    // (gemv.h's task_quads).
    if constexpr (std::is_same_v<W, E4m3>) {
      if (M == 1 && quads_fit(rows.column_block())) {
        std::vector<float> xq(quad_len(K));
        quad_order(xp, K, xq.data());
        task_calls(rows, [&] {
          return [&](const RowTask&, const TaskRows& task_rows, float (*const* out)[kLanes]) {
            task_quads(task_rows, xq.data(), K, rows.column_block(), out);
          };
        });
        return;
      }
    }
#endif
    if constexpr (scaled_tokens) {
      task_calls(rows, [&] {
        // consecutive tasks of a thread mostly share a row block: scale the tokens once per block
        return [&, xs_buf = std::vector<float>(M * direct_len(K)), prepared_for = int64_t{-1}](
                   const RowTask& task, const TaskRows& task_rows, float (*const* out)[kLanes]) mutable {
          if (task.scale_row != prepared_for) rows.scale_tokens(task, xp, M, K, xs_buf.data());
          prepared_for = task.scale_row;
          const float* xs[Rows::kDirectMax];
          for (int64_t j = 0; j < M; ++j) xs[j] = xs_buf.data() + j * direct_len(K);
          const float* const* token_rows[2] = {xs, nullptr};
          dot_task_rows(task_rows, token_rows, static_cast<int>(M), K, out);
        };
      });
    } else {
      // 16-bit rows, two at a time against the M tokens, the pair kAheadBytes on requested meanwhile (``ahead``
      // counts rows of one stream: requesting r + ahead and the row after it from pair r would, for rows of more
      // than 4 KiB, ask again for the pair's own second row and leave every other row unrequested; linear16 4096 x
      // 4096 ran 1.4-2.0x slower at one token that way on avx2, 1.2-1.3x on avx512, caches flushed)
      const int64_t pair_ahead = 2 * rows_ahead(2 * K * static_cast<int64_t>(sizeof(W)));
      const float* xs[Rows::kDirectMax];
      for (int64_t j = 0; j < M; ++j) xs[j] = xp + j * K;
      at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t end) {
        float acc[2][Rows::kDirectMax];
        for (; b < end; ++b) {
          const RowTask& task = tasks[b];
          const int64_t last = task.row0 + task.rows;
          for (int64_t r = task.row0; r < last; r += 2) {
            const int nr = static_cast<int>(std::min<int64_t>(2, last - r));
            const W* pair[2] = {rows.row(r), rows.row(r + nr - 1)};
            const int64_t rn = std::min(r + pair_ahead, N - 2);
            const int64_t ra = std::max<int64_t>(rn, 0);  // rn < 0 (one row): nothing to prefetch
            const W* next[2] = {rows.row(ra), rows.row(ra + 1)};
            dot_rows(pair, rn >= 0 ? next : nullptr, nr, xs, static_cast<int>(M), K, acc);
            for (int64_t j = 0; j < M; ++j)
              for (int i = 0; i < nr; ++i) op[j * N + r + i] = static_cast<scalar_t>(acc[i][j]);
          }
        }
      });
    }
  });
}

void check_linear_inputs(const char* what, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, what, ": x [M, K], weight [N, K]");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), what, ": tensors must be on the CPU");
  TORCH_CHECK(weight.size(1) == x.size(1), what, ": weight has ", weight.size(1), " columns for ", x.size(1),
              " inputs");
}

}  // namespace

// x [M, K] float32 / bf16 / fp16, weight [N, K] bfloat16 / float16 -> out [M, N] in x's dtype (float32 sums).
at::Tensor linear16(const at::Tensor& x_, const at::Tensor& weight_) {
  const char* what = "linear16";
  check_linear_inputs(what, x_, weight_);
  TORCH_CHECK(weight_.scalar_type() == at::kBFloat16 || weight_.scalar_type() == at::kHalf, what,
              ": weight must be bfloat16 or float16, got ", weight_.scalar_type());
  const int64_t M = x_.size(0), K = x_.size(1), N = weight_.size(0);
  at::Tensor out = at::empty({M, N}, x_.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const at::Tensor x = x_.to(at::kFloat).contiguous();
  const at::Tensor w = weight_.stride(1) == 1 ? weight_ : weight_.contiguous();
  const std::vector<RowTask> tasks = row_tasks({N}, ceil_div(N, kRowsPerTask) * kRowsPerTask);
  if (w.scalar_type() == at::kBFloat16)
    run_linear(x, tasks, Rows16<c10::BFloat16>{w.data_ptr<c10::BFloat16>(), w.stride(0)}, out);
  else
    run_linear(x, tasks, Rows16<c10::Half>{w.data_ptr<c10::Half>(), w.stride(0)}, out);
  return out;
}

// x [M, K] float32 / bf16 / fp16, weight [N, K] float8_e4m3fn, scale [S, ceil(K / bk)] float32 (S: the last
// part's first scale row plus its row blocks), parts: row counts summing to N -> out [M, N] in x's dtype.
namespace {

// A block-FP8 weight [N, K] fused from ``parts`` with its float32 block scales, as fp8_linear and fp8_dequantize
// take it: checked, with the parts as a vector.
std::vector<int64_t> check_fp8_weight(const char* what, const at::Tensor& weight, const at::Tensor& scale,
                                      at::IntArrayRef parts_, int64_t block_n, int64_t block_k) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), what, ": weight must be a 2-D CPU tensor");
  TORCH_CHECK(scale.dim() == 2 && scale.device().is_cpu(), what, ": scale must be a 2-D CPU tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn, what, ": weight must be float8_e4m3fn");
  TORCH_CHECK(scale.scalar_type() == at::kFloat, what, ": scale must be float32");
  check_fp8_blocks(what, block_n, block_k);
  const int64_t N = weight.size(0), KB = ceil_div(weight.size(1), block_k);
  std::vector<int64_t> parts(parts_.begin(), parts_.end());
  TORCH_CHECK(!parts.empty(), what, ": parts must name at least one part");
  int64_t total = 0;
  for (const int64_t n : parts) {
    TORCH_CHECK(n > 0, what, ": part sizes must be positive, got ", parts_);
    total += n;
  }
  TORCH_CHECK(total == N, what, ": parts ", parts_, " do not add up to the weight's ", N, " rows");
  const int64_t scale_rows = ceil_div(N - parts.back(), block_n) + ceil_div(parts.back(), block_n);
  TORCH_CHECK(scale.size(0) == scale_rows && scale.size(1) == KB, what, ": scale must be [", scale_rows, ", ",
              KB, "] for parts ", parts_, " and blocks [", block_n, ", ", block_k, "], got ", scale.sizes());
  return parts;
}

}  // namespace

at::Tensor fp8_linear(const at::Tensor& x_, const at::Tensor& weight_, const at::Tensor& scale_,
                      at::IntArrayRef parts_, int64_t block_n, int64_t block_k) {
  const char* what = "fp8_linear";
  check_linear_inputs(what, x_, weight_);
  const std::vector<int64_t> parts = check_fp8_weight(what, weight_, scale_, parts_, block_n, block_k);
  const int64_t M = x_.size(0), K = x_.size(1), N = weight_.size(0), KB = ceil_div(K, block_k);
  at::Tensor out = at::empty({M, N}, x_.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const at::Tensor x = x_.to(at::kFloat).contiguous();
  const at::Tensor w = weight_.stride(1) == 1 ? weight_ : weight_.contiguous();
  const at::Tensor scale = scale_.contiguous();
  const RowsFp8 rows{reinterpret_cast<const E4m3*>(w.data_ptr()), w.stride(0), scale.data_ptr<float>(), KB, block_k};
  run_linear(x, row_tasks(parts, block_n), rows, out);
  return out;
}

// out [N, K] (bfloat16, float16 or float32) = the float values of a block-FP8 weight (as fp8_linear takes it): each
// float(w) * scale formed in float32 and rounded once, the reference dequantization (quant/fp8_block.py) bit for
// bit. fp8.py hands a bfloat16 copy of a weight with many tokens to the GEMMs of CPUs with native bfloat16
// arithmetic, writing it into a buffer it keeps (a fresh one would cost more in page faults than the conversion).
void fp8_dequantize(const at::Tensor& weight_, const at::Tensor& scale_, at::IntArrayRef parts_, int64_t block_n,
                    int64_t block_k, at::Tensor& out) {
  const char* what = "fp8_dequantize";
  const std::vector<int64_t> parts = check_fp8_weight(what, weight_, scale_, parts_, block_n, block_k);
  const int64_t N = weight_.size(0), K = weight_.size(1), KB = ceil_div(K, block_k);
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous(),
              what, ": out must be a contiguous CPU tensor [", N, ", ", K, "], got ", out.sizes());
  if (N == 0 || K == 0) return;
  const at::Tensor w = weight_.stride(1) == 1 ? weight_ : weight_.contiguous();
  const at::Tensor scale = scale_.contiguous();
  const RowsFp8 rows{reinterpret_cast<const E4m3*>(w.data_ptr()), w.stride(0), scale.data_ptr<float>(), KB, block_k};
  const std::vector<RowTask> tasks = row_tasks(parts, block_n);
  GLM53_DISPATCH_FLOAT_TYPES(out.scalar_type(), "fp8_dequantize output", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t end) {
      for (; b < end; ++b)
        for (int64_t r = tasks[b].row0; r < tasks[b].row0 + tasks[b].rows; ++r)
          rows.widen(tasks[b], r, 0, K, op + r * K);
    });
  });
}

}  // namespace glm53
