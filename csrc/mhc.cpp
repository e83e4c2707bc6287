// mHC (manifold-constrained hyper-connections) on CPU: the coefficient GEMM with its normalised input and the
// small per-token pieces around it.
// Same maths as vllm_glm53/backends/cpu/mhc.py (its *_torch forms are the reference), n = hc_mult streams:
//
//   mhc_mix           m    = xn @ fn^T                            [(2+n)n], xn = x * rsqrt(mean(x^2) + norm_eps),
//                                                                  x = the token's n*D stream values, flattened
//   mhc_coefficients  pre  = sigmoid(s_pre m[:n] + b) + eps ;  post = 2 sigmoid(s_post m[n:2n] + b)
//                     comb = Sinkhorn(softmax_j(s_comb M + B) + eps),  M[i, j] = m[2n + i n + j]
//   mhc_collapse      u    = sum_i pre_i X_i
//   mhc_expand        X'_j = post_j y + sum_i comb[i, j] X_i
//
// In the torch form the coefficients alone are some 150 tiny ops per block (the 20-iteration Sinkhorn loop is
// over 100 of them) whose dispatch, not arithmetic, is the cost: here one pass per token. The coefficient maths follows the torch
// form's order of operations step by step (each Sinkhorn sum runs in index order, every normalisation is a true
// division, as torch's are), so the two agree to float32 rounding: the exp inside the sigmoid and the softmax,
// the RMS norm's sum of squares and mhc_mix's dot products (lane-wise partial sums, not torch's GEMM order) are
// the only differently rounded steps (a few ulp). Tokens are independent and split over threads.

#include <memory>

#include "gemv.h"

namespace glm53 {
namespace {

constexpr int64_t kMaxStreams = 16;

at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

at::Tensor float_contiguous(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

void check_streams(const at::Tensor& X, const char* what) {
  TORCH_CHECK(X.dim() == 3, what, ": streams must be [T, n, D], got ", X.sizes());
  TORCH_CHECK(X.size(1) <= kMaxStreams, what, ": at most ", kMaxStreams, " streams, got ", X.size(1));
}

// The per-token steps are written for a runtime stream count ``n``; instantiated with a fixed ``N`` (the
// model's 4) the loops unroll into short vector instructions, about 1.5x faster. N = 0 means "use n".

// Divides every column of the n x n row-major ``c`` by (its sum + eps); the sums run down the rows in order.
template <int64_t N>
void normalise_columns(float* c, int64_t n_, float eps) {
  const int64_t n = N > 0 ? N : n_;
  float sums[kMaxStreams];
  for (int64_t j = 0; j < n; ++j) sums[j] = c[j];
  for (int64_t i = 1; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) sums[j] += c[i * n + j];
  for (int64_t j = 0; j < n; ++j) sums[j] += eps;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) c[i * n + j] /= sums[j];
}

template <int64_t N>
void normalise_rows(float* c, int64_t n_, float eps) {
  const int64_t n = N > 0 ? N : n_;
  for (int64_t i = 0; i < n; ++i) {
    float* row = c + i * n;
    float s = row[0];
    for (int64_t j = 1; j < n; ++j) s += row[j];
    s += eps;
    for (int64_t j = 0; j < n; ++j) row[j] /= s;
  }
}

inline float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// One token: m [(2+n)n] -> pre [n], post [n], comb [n, n].
template <int64_t N>
void token_coefficients(const float* m, const float* base, const float scale[3], int64_t n_, float eps,
                        int64_t iters, float* pre, float* post, float* comb) {
  const int64_t n = N > 0 ? N : n_;
  for (int64_t i = 0; i < n; ++i) {
    const float zp = m[i] * scale[0] + base[i];
    const float zq = m[n + i] * scale[1] + base[n + i];
    pre[i] = sigmoid(zp) + eps;
    post[i] = 2.0f * sigmoid(zq);
  }
  const float* mc = m + 2 * n;
  const float* bc = base + 2 * n;
  for (int64_t i = 0; i < n; ++i) {
    float* row = comb + i * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      row[j] = mc[i * n + j] * scale[2] + bc[i * n + j];
      mx = std::max(mx, row[j]);
    }
    float s = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = std::exp(row[j] - mx);
      s += row[j];
    }
    const float inv = 1.0f / s;  // torch's softmax scales by the reciprocal of the sum
    for (int64_t j = 0; j < n; ++j) row[j] = row[j] * inv + eps;
  }
  normalise_columns<N>(comb, n, eps);
  for (int64_t it = 1; it < iters; ++it) {
    normalise_rows<N>(comb, n, eps);
    normalise_columns<N>(comb, n, eps);
  }
}

}  // namespace

// Tokens up to which mhc_mix multiplies with its own dot products; above, the normalised rows go to torch's GEMM.
// Both run at about the FMA rate (one thread, warm, bfloat16 streams, one Intel Xeon core): kernel-friendly tiny
// block (fn 24 x 2,048) 4 / 8 / 30 us at 1 / 4 / 16 tokens against torch's mm alone at 5 / 6 / 32 plus the
// normalisation (~8 us at 16) and the calls between; 37 vs 38 at 24, 58 vs 44 at 32. Released width (fn 24 x
// 24,576): 102 / 398 us at 4 / 16 against 140 / 437 for the mm alone, 596 vs 507 at 24.
constexpr int64_t kMixOwnMaxTokens = 16;

namespace {

// One token's flattened streams (n rows of D at stride ss) times rsqrt(mean of their squares + eps) into ot [n*D].
template <typename scalar_t>
void normalise_token(const scalar_t* xt, int64_t ss, int64_t n, int64_t D, float eps, float* ot) {
  F16 acc0 = zero(), acc1 = zero();
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* xi = xt + i * ss;
    int64_t d = 0;
    for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
      F16 a = load(xi + d, kLanes), b = load(xi + d + kLanes, kLanes);
      acc0 = fma(a, a, acc0);
      acc1 = fma(b, b, acc1);
    }
    for (; d < D; d += kLanes) {
      const int w = static_cast<int>(std::min<int64_t>(kLanes, D - d));
      F16 a = load(xi + d, w);
      acc0 = fma(a, a, acc0);
    }
  }
  const float mean = reduce_add(acc0 + acc1) / static_cast<float>(n * D);
  const F16 r = set1(1.0f / std::sqrt(mean + eps));
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* xi = xt + i * ss;
    for (int64_t d = 0; d < D; d += kLanes) {
      const int w = static_cast<int>(std::min<int64_t>(kLanes, D - d));
      store(ot + i * D + d, load(xi + d, w) * r, w);
    }
  }
}

// fn rows per register tile of mhc_mix: kMixRows x kTok accumulators (16 of AVX-512's 32 registers; avx2 and
// portable: 2 x 2 of their 4-8 vectors).
constexpr int kMixRows = kVectorRegs >= 32 ? 4 : 2;

// acc[q][j] = dot(rows[q], xs[j]) for nr <= R rows and g <= kTok tokens (nr picks the instantiation).
template <int R = kMixRows>
void mix_rows(int nr, const float* const* rows, const float* const* xs, int g, int64_t K, float (*acc)[kTok]) {
  if constexpr (R > 1)
    if (nr < R) return mix_rows<R - 1>(nr, rows, xs, g, K, acc);
  dot_tokens<R>(rows, nullptr, xs, g, K, acc);
}

}  // namespace

// The coefficient GEMM's output m = xn @ fn^T: X [T, n, D] (float32 / bf16 / fp16; any token and stream strides,
// rows contiguous), fn [W, n*D] -> [T, W] float32, xn each token's flattened streams times rsqrt(mean of their
// squares + eps). A decode step's few tokens are normalised a group at a time into a buffer and dotted with fn's
// rows here (one call where there were the norm, a transpose and torch's mm); more go to torch's GEMM.
at::Tensor mhc_mix(const at::Tensor& X_, const at::Tensor& fn_, double eps_) {
  check_streams(X_, "mhc_mix");
  at::Tensor X = last_dim_contiguous(X_), fn = float_contiguous(fn_);
  const int64_t T = X.size(0), n = X.size(1), D = X.size(2), K = n * D;
  TORCH_CHECK(fn.dim() == 2 && fn.size(1) == K, "mhc_mix: fn must be [W, ", K, "], got ", fn.sizes());
  const int64_t W = fn.size(0);
  const float eps = static_cast<float>(eps_);
  if (T > kMixOwnMaxTokens) {
    at::Tensor xn = at::empty({T, K}, X.options().dtype(at::kFloat));
    GLM53_DISPATCH_FLOAT_TYPES(X.scalar_type(), "mhc_mix", [&] {
      const scalar_t* xp = X.data_ptr<scalar_t>();
      float* op = xn.data_ptr<float>();
      at::parallel_for(0, T, token_grain(K), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) normalise_token(xp + t * X.stride(0), X.stride(1), n, D, eps, op + t * K);
      });
    });
    return at::mm(xn, fn.t());
  }
  at::Tensor out = at::empty({T, W}, X.options().dtype(at::kFloat));
  GLM53_DISPATCH_FLOAT_TYPES(X.scalar_type(), "mhc_mix", [&] {
    const scalar_t* xp = X.data_ptr<scalar_t>();
    const float* fp = fn.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, T, kTok, [&](int64_t t0, int64_t t1) {
      // Each group of kTok tokens, normalised into a buffer (L1 / L2), against all of fn's rows, kMixRows at a time
      // streaming in: the loop order that re-reads the tokens, not fn's rows.
      std::unique_ptr<float[]> xn(new float[kTok * K]);
      const float* xs[kTok];
      float acc[kMixRows][kTok];
      for (int64_t j0 = t0; j0 < t1; j0 += kTok) {
        const int g = static_cast<int>(std::min<int64_t>(kTok, t1 - j0));
        for (int j = 0; j < g; ++j) {
          normalise_token(xp + (j0 + j) * X.stride(0), X.stride(1), n, D, eps, xn.get() + j * K);
          xs[j] = xn.get() + j * K;
        }
        for (int64_t r = 0; r < W; r += kMixRows) {
          const int nr = static_cast<int>(std::min<int64_t>(kMixRows, W - r));
          const float* rows[kMixRows];
          for (int q = 0; q < nr; ++q) rows[q] = fp + (r + q) * K;
          mix_rows(nr, rows, xs, g, K, acc);
          for (int q = 0; q < nr; ++q)
            for (int j = 0; j < g; ++j) op[(j0 + j) * W + r + q] = acc[q][j];
        }
      }
    });
  });
  return out;
}

// m [T, (2+n)n] (the GEMM output), base [(2+n)n], scale [3] -> float32 pre [T, n], post [T, n], comb [T, n, n].
std::tuple<at::Tensor, at::Tensor, at::Tensor> mhc_coefficients(const at::Tensor& m_, const at::Tensor& base_,
                                                                const at::Tensor& scale_, int64_t n, double eps_,
                                                                int64_t sinkhorn_iters) {
  TORCH_CHECK(n >= 1 && n <= kMaxStreams, "mhc_coefficients: n must be in [1, ", kMaxStreams, "], got ", n);
  TORCH_CHECK(sinkhorn_iters >= 1, "mhc_coefficients: need at least one Sinkhorn iteration");
  const int64_t width = (2 + n) * n;
  TORCH_CHECK(m_.dim() == 2 && m_.size(1) == width, "mhc_coefficients: m must be [T, ", width, "], got ", m_.sizes());
  at::Tensor m = float_contiguous(m_), base = float_contiguous(base_), scale_t = float_contiguous(scale_);
  TORCH_CHECK(base.numel() == width && scale_t.numel() == 3, "mhc_coefficients: base must have ", width,
              " values and scale 3");
  const int64_t T = m.size(0);
  at::Tensor pre = at::empty({T, n}, m.options()), post = at::empty({T, n}, m.options()),
             comb = at::empty({T, n, n}, m.options());
  const float eps = static_cast<float>(eps_);
  const float* sp = scale_t.data_ptr<float>();
  const float scale[3] = {sp[0], sp[1], sp[2]};
  const float *mp = m.data_ptr<float>(), *bp = base.data_ptr<float>();
  float *prep = pre.data_ptr<float>(), *postp = post.data_ptr<float>(), *combp = comb.data_ptr<float>();
  // The Sinkhorn rounds are one dependent chain of sums and divisions, ~0.4 us per token for n = 4.
  at::parallel_for(0, T, 32, [&](int64_t t0, int64_t t1) {
    const auto token = n == 4 ? &token_coefficients<4> : &token_coefficients<0>;
    for (int64_t t = t0; t < t1; ++t)
      token(mp + t * width, bp, scale, n, eps, sinkhorn_iters, prep + t * n, postp + t * n, combp + t * n * n);
  });
  return {pre, post, comb};
}

// u = sum_i pre_i X_i: X [T, n, D] (float32 / bf16 / fp16), pre [T, n] -> [T, D] in X's dtype, float32 sums.
at::Tensor mhc_collapse(const at::Tensor& X_, const at::Tensor& pre_) {
  check_streams(X_, "mhc_collapse");
  at::Tensor X = last_dim_contiguous(X_), pre = float_contiguous(pre_);
  const int64_t T = X.size(0), n = X.size(1), D = X.size(2);
  TORCH_CHECK(pre.dim() == 2 && pre.size(0) == T && pre.size(1) == n, "mhc_collapse: pre must be [T, n]");
  at::Tensor out = at::empty({T, D}, X.options());
  GLM53_DISPATCH_FLOAT_TYPES(X.scalar_type(), "mhc_collapse", [&] {
    const scalar_t* xp = X.data_ptr<scalar_t>();
    const float* pp = pre.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t ts = X.stride(0), ss = X.stride(1);
    at::parallel_for(0, T, token_grain(n * D), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* xt = xp + t * ts;
        for (int64_t d = 0; d < D; d += kLanes) {
          const int w = static_cast<int>(std::min<int64_t>(kLanes, D - d));
          F16 acc = zero();
          for (int64_t i = 0; i < n; ++i) acc = acc + set1(pp[t * n + i]) * load(xt + i * ss + d, w);
          store(op + t * D + d, acc, w);
        }
      }
    });
  });
  return out;
}

// X'_j = post_j y + sum_i comb[i, j] X_i: X [T, n, D], y [T, D] (X's dtype), post [T, n], comb [T, n, n]
// -> [T, n, D] in X's dtype, float32 maths.
at::Tensor mhc_expand(const at::Tensor& X_, const at::Tensor& y_, const at::Tensor& post_, const at::Tensor& comb_) {
  check_streams(X_, "mhc_expand");
  at::Tensor X = last_dim_contiguous(X_), y = last_dim_contiguous(y_);
  at::Tensor post = float_contiguous(post_), comb = float_contiguous(comb_);
  const int64_t T = X.size(0), n = X.size(1), D = X.size(2);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == T && y.size(1) == D, "mhc_expand: y must be [T, D]");
  TORCH_CHECK(y.scalar_type() == X.scalar_type(), "mhc_expand: y must have the streams' dtype");
  TORCH_CHECK(post.numel() == T * n && comb.numel() == T * n * n, "mhc_expand: post [T, n], comb [T, n, n]");
  at::Tensor out = at::empty({T, n, D}, X.options());
  GLM53_DISPATCH_FLOAT_TYPES(X.scalar_type(), "mhc_expand", [&] {
    const scalar_t* xp = X.data_ptr<scalar_t>();
    const scalar_t* yp = y.data_ptr<scalar_t>();
    const float *pp = post.data_ptr<float>(), *cp = comb.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t ts = X.stride(0), ss = X.stride(1), ys = y.stride(0);
    at::parallel_for(0, T, token_grain(2 * n * D), [&](int64_t t0, int64_t t1) {
      F16 xs[kMaxStreams];
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* xt = xp + t * ts;
        const float* c = cp + t * n * n;
        for (int64_t d = 0; d < D; d += kLanes) {
          const int w = static_cast<int>(std::min<int64_t>(kLanes, D - d));
          for (int64_t i = 0; i < n; ++i) xs[i] = load(xt + i * ss + d, w);
          const F16 yv = load(yp + t * ys + d, w);
          for (int64_t j = 0; j < n; ++j) {
            F16 mixed = set1(c[j]) * xs[0];
            for (int64_t i = 1; i < n; ++i) mixed = fma(set1(c[i * n + j]), xs[i], mixed);
            store(op + (t * n + j) * D + d, set1(pp[t * n + j]) * yv + mixed, w);
          }
        }
      }
    });
  });
  return out;
}

}  // namespace glm53
