// KDA (Kimi Delta Attention) on CPU: the delta rule and the short convolution for a whole batch over vLLM's
// state pools (decodes, prefills, continued prefill chunks and speculative verification in one call each). Same
// maths and layouts as vllm_glm53/backends/cpu/kda.py (state [H, dk, dv] float32, key-major).
//
// Per head and token, with a = exp(g):
//     S' = diag(a) S ;  r = S'^T k ;  u = beta (v - r) ;  S <- S' + k u^T ;  o = S^T q (the new S)
// is evaluated as
//     r = S^T (a*k) ;  o0 = S^T (a*q) ;  u = beta (v - r) ;  o = o0 + (k.q) u ;  S <- a*S + k u^T
// so one token touches the state twice: a read pass (r and o0) and an update pass. Columns of S are independent
// (column j only needs r_j and u_j), so the state is processed in groups of up to 64 columns with AVX-512, 32
// with AVX2 (whose 16 registers hold half the accumulators; dk x 64 floats = 32 KiB at dk = 128): the update
// pass finds the group in L1, and for a prefill the group stays there for the whole sequence. Memory sees each state element read once and written once per call.

#include "common.h"


namespace glm53 {
namespace {

// Columns per group = kGroupVecs * 16: the read pass keeps 2 * kGroupVecs accumulators (r and o0) in registers.
constexpr int kGroupVecs = kVectorRegs >= 32 ? 4 : 2;

// Pointers to one head's inputs for a run of tokens; ``*_ts`` are token strides in elements.
struct HeadInputs {
  const float* q;
  const float* k;
  const float* g;
  const float* v;  // already offset to the group's first column
  const float* beta;
  int64_t q_ts, k_ts, g_ts, v_ts, beta_ts;
  float* o;  // already offset to the group's first column
  int64_t o_ts;
};

// Runs ``n_tok`` tokens of the delta rule on the column group of one head. ``S`` points at row 0 of the group
// (row stride ``ldS``), ``ncols`` <= NV * 16 valid columns. ``scratch`` holds 3 * dk floats. ``ahead`` (or null):
// row 0 of the group the caller runs next, with the same row stride, whose lines the read pass requests row by row.
// A group's rows are a strip of a few lines each (2 of a row's 8 with AVX2), which the hardware prefetchers follow
// poorly, so a decode waited on every strip it read: asking one group ahead took the KDA decode step 4-20 % down
// (batch 16 and 64, avx2 and avx512 builds, both forms in one process; benchmarks/README.md).
template <int NV>
void recur_group(float* S, int64_t ldS, int64_t dk, int ncols, const HeadInputs& in, int64_t n_tok,
                 float* scratch, const float* ahead) {
  int cols[NV];
  for (int j = 0; j < NV; ++j) cols[j] = std::max(0, std::min(kLanes, ncols - j * kLanes));
  float* a = scratch;
  float* ak = scratch + dk;
  float* aq = scratch + 2 * dk;

  for (int64_t t = 0; t < n_tok; ++t) {
    const float* q = in.q + t * in.q_ts;
    const float* k = in.k + t * in.k_ts;
    const float* g = in.g + t * in.g_ts;
    const float* v = in.v + t * in.v_ts;
    const float beta = in.beta[t * in.beta_ts];
    float* o = in.o + t * in.o_ts;

    F16 kq_acc = zero();
    for (int64_t i = 0; i < dk; i += kLanes) {
      int m = static_cast<int>(std::min<int64_t>(kLanes, dk - i));
      F16 av = exp(load(g + i, m));
      F16 kv = load(k + i, m), qv = load(q + i, m);
      store(a + i, av, m);
      store(ak + i, av * kv, m);
      store(aq + i, av * qv, m);
      kq_acc = fma(kv, qv, kq_acc);
    }
    const float kq = reduce_add(kq_acc);

    // Read pass: r = S^T (a*k), o0 = S^T (a*q).
    F16 r[NV], o0[NV];
    for (int j = 0; j < NV; ++j) r[j] = o0[j] = zero();
    for (int64_t i = 0; i < dk; ++i) {
      const float* row = S + i * ldS;
      if (ahead != nullptr && t == 0) {
        const char* next = reinterpret_cast<const char*>(ahead + i * ldS);
        for (int b = 0; b < ncols * static_cast<int>(sizeof(float)); b += 64) __builtin_prefetch(next + b, 1, 3);
      }
      F16 aki = set1(ak[i]), aqi = set1(aq[i]);
      for (int j = 0; j < NV; ++j) {
        F16 s = load(row + j * kLanes, cols[j]);
        r[j] = fma(aki, s, r[j]);
        o0[j] = fma(aqi, s, o0[j]);
      }
    }
    F16 u[NV];
    F16 bv = set1(beta), kqv = set1(kq);
    for (int j = 0; j < NV; ++j) {
      u[j] = bv * (load(v + j * kLanes, cols[j]) - r[j]);
      store(o + j * kLanes, fma(kqv, u[j], o0[j]), cols[j]);
    }
    // Update pass: S <- a*S + k u^T.
    for (int64_t i = 0; i < dk; ++i) {
      float* row = S + i * ldS;
      F16 ai = set1(a[i]), ki = set1(k[i]);
      for (int j = 0; j < NV; ++j) {
        F16 s = load(row + j * kLanes, cols[j]);
        store(row + j * kLanes, fma(ki, u[j], s * ai), cols[j]);
      }
    }
  }
}

void run_group(float* S, int64_t ldS, int64_t dk, int ncols, const HeadInputs& in, int64_t n_tok, float* scratch,
               const float* ahead = nullptr) {
  switch ((ncols + kLanes - 1) / kLanes) {
    case 1: return recur_group<1>(S, ldS, dk, ncols, in, n_tok, scratch, ahead);
    case 2: return recur_group<2>(S, ldS, dk, ncols, in, n_tok, scratch, ahead);
    case 3: return recur_group<3>(S, ldS, dk, ncols, in, n_tok, scratch, ahead);
    default: return recur_group<kGroupVecs>(S, ldS, dk, ncols, in, n_tok, scratch, ahead);
  }
}

at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "kda: ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), "kda: ", name, " must be on the CPU");
}

}  // namespace


// ----------------------------------------------------------------------------------------------------------------
// Batch-wide (varlen) forms: every request of a step in one call, reading and writing vLLM's state pools through
// the step plan (vllm_glm53/backends/plans.py, StateSlots). Request r owns tokens cu_seqlens[r] .. cu_seqlens[r+1]
// of the batch; it starts from the state in pool slot state_in[r] (-1: from zeros, a fresh sequence) and, for each
// column j with state_out_at[r, j] >= 0, the state right after its token state_out_at[r, j] is stored in slot
// state_out[r, j]. A decode or prefill stores once, after its last token, in its own slot; a request verifying
// speculative drafts stores after every token, one slot per draft position, so whichever draft the sampler
// accepts, the next step starts from the right state. Zero-length requests (padding) are skipped.
// ----------------------------------------------------------------------------------------------------------------
namespace {

// One request's state bookkeeping, validated once before the parallel region.
struct StateSchedule {
  const int64_t* cu;
  const int64_t* in;
  const int64_t* out;
  const int64_t* at;
  int64_t W;
  // Output columns of request r sorted by the token they follow (W is 1 + the draft count: a few entries).
  void sorted_outputs(int64_t r, std::vector<std::pair<int64_t, int64_t>>& outs) const {
    outs.clear();
    for (int64_t j = 0; j < W; ++j)
      if (at[r * W + j] >= 0) outs.emplace_back(at[r * W + j], out[r * W + j]);
    std::sort(outs.begin(), outs.end());
  }
};

StateSchedule check_schedule(const at::Tensor& cu, const at::Tensor& in, const at::Tensor& out,
                             const at::Tensor& at_, int64_t n_tokens, int64_t n_slots, const char* op) {
  const int64_t R = in.numel();
  TORCH_CHECK(cu.numel() == R + 1, op, ": cu_seqlens needs num_reqs + 1 entries");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == R && at_.sizes() == out.sizes(),
              op, ": state_out and state_out_at must both be [num_reqs, W]");
  StateSchedule s{cu.data_ptr<int64_t>(), in.data_ptr<int64_t>(), out.data_ptr<int64_t>(), at_.data_ptr<int64_t>(),
                  out.size(1)};
  TORCH_CHECK(s.cu[0] >= 0 && s.cu[R] <= n_tokens, op, ": cu_seqlens outside the ", n_tokens, " tokens");
  for (int64_t r = 0; r < R; ++r) {
    const int64_t len = s.cu[r + 1] - s.cu[r];
    TORCH_CHECK(len >= 0, op, ": cu_seqlens must not decrease");
    TORCH_CHECK(s.in[r] < n_slots, op, ": state_in slot ", s.in[r], " outside the pool of ", n_slots);
    for (int64_t j = 0; j < s.W; ++j) {
      const int64_t t = s.at[r * s.W + j], slot = s.out[r * s.W + j];
      if (t < 0) continue;
      TORCH_CHECK(t < len, op, ": request ", r, " stores a state after token ", t, " of ", len);
      TORCH_CHECK(slot >= 0 && slot < n_slots, op, ": state_out slot ", slot, " outside the pool of ", n_slots);
    }
  }
  return s;
}

at::Tensor as_long(const at::Tensor& t) { return t.to(at::kLong).contiguous(); }

}  // namespace

// q, k, g [T, H, dk], v [T, H, dv], beta [T, H] float32; pool [N, H, dk, dv] float32 (rows contiguous, any
// slot/head strides), read and written per the schedule above. Returns o [T, H, dv] float32 (zeros for tokens
// outside every request). Each (request, head, column group) is an independent task: its state group is copied
// into an L1-sized buffer, run token by token through recur_group, and
// copied out at each store point, so memory sees each state read once and written once per store.
at::Tensor kda_varlen(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& g_,
                      const at::Tensor& beta, at::Tensor& pool, const at::Tensor& cu_seqlens,
                      const at::Tensor& state_in, const at::Tensor& state_out, const at::Tensor& state_out_at) {
  for (const at::Tensor* p : {&q_, &k_, &v_, &g_, &beta, static_cast<const at::Tensor*>(&pool)})
    check_f32(*p, "inputs and state pool");
  at::Tensor q = last_dim_contiguous(q_), k = last_dim_contiguous(k_), v = last_dim_contiguous(v_),
             g = last_dim_contiguous(g_);
  const int64_t T = q.size(0), H = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(k.sizes() == q.sizes() && g.sizes() == q.sizes(), "kda_varlen: q, k, g shapes differ");
  TORCH_CHECK(v.size(0) == T && v.size(1) == H && beta.size(0) == T && beta.size(1) == H,
              "kda_varlen: v / beta shapes do not match q");
  TORCH_CHECK(pool.dim() == 4 && pool.size(1) == H && pool.size(2) == dk && pool.size(3) == dv,
              "kda_varlen: pool must be [N, H, dk, dv]");
  TORCH_CHECK(pool.stride(3) == 1, "kda_varlen: pool rows must be contiguous");
  at::Tensor cu = as_long(cu_seqlens), in = as_long(state_in), out = as_long(state_out), at_ = as_long(state_out_at);
  const StateSchedule sched = check_schedule(cu, in, out, at_, T, pool.size(0), "kda_varlen");
  const int64_t R = in.numel();

  at::Tensor o = at::zeros({T, H, dv}, q.options());
  const int64_t group_cols = kGroupVecs * kLanes;
  const int64_t n_groups = (dv + group_cols - 1) / group_cols;
  float* sp = pool.data_ptr<float>();
  const int64_t ps0 = pool.stride(0), ps1 = pool.stride(1), ps2 = pool.stride(2);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *gp = g.data_ptr<float>(),
              *vp = v.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = o.data_ptr<float>();

  // A task is (request, head, group of columns); the state it starts from, row 0 of its group (null: zeros).
  auto state_of = [&](int64_t task) -> float* {
    const int64_t r = task / (H * n_groups), h = (task / n_groups) % H, grp = task % n_groups;
    const int64_t slot_in = sched.in[r];
    return slot_in >= 0 && sched.cu[r + 1] > sched.cu[r] ? sp + slot_in * ps0 + h * ps1 + grp * group_cols : nullptr;
  };
  at::parallel_for(0, R * H * n_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(3 * dk), S(dk * group_cols);
    std::vector<std::pair<int64_t, int64_t>> outs;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / (H * n_groups), h = (task / n_groups) % H, grp = task % n_groups;
      const int64_t t0 = sched.cu[r], len = sched.cu[r + 1] - t0;
      if (len == 0) continue;
      const int64_t c0 = grp * group_cols;
      const int ncols = static_cast<int>(std::min(group_cols, dv - c0));
      const int64_t slot_in = sched.in[r];
      float* group_in = state_of(task);
      sched.sorted_outputs(r, outs);
      auto inputs = [&](int64_t t) {  // the head's inputs from token t of the request on
        const int64_t tok = t0 + t;
        return HeadInputs{qp + tok * q.stride(0) + h * q.stride(1), kp + tok * k.stride(0) + h * k.stride(1),
                          gp + tok * g.stride(0) + h * g.stride(1), vp + tok * v.stride(0) + h * v.stride(1) + c0,
                          bp + tok * beta.stride(0) + h * beta.stride(1),
                          q.stride(0), k.stride(0), g.stride(0), v.stride(0), beta.stride(0),
                          op + tok * o.stride(0) + h * o.stride(1) + c0, o.stride(0)};
      };
      // A decode that stores its state back into the slot it read (the common step) runs on the pool in place:
      // its one token gains nothing from a staged copy, which cost more than the recurrence (two row copies per
      // state row).
      if (len == 1 && outs.size() == 1 && outs[0].second == slot_in && group_in != nullptr) {
        const float* ahead = task + 1 < end ? state_of(task + 1) : nullptr;
        run_group(group_in, ps2, dk, ncols, inputs(0), 1, scratch.data(), ahead);
        continue;
      }
      for (int64_t i = 0; i < dk; ++i) {
        float* dst = S.data() + i * group_cols;
        if (group_in != nullptr) from_float(group_in + i * ps2, dst, ncols);
        else std::fill(dst, dst + ncols, 0.0f);
      }
      int64_t t = 0;
      auto run = [&](int64_t upto) {  // tokens t .. upto - 1 of the request
        if (upto <= t) return;
        run_group(S.data(), group_cols, dk, ncols, inputs(t), upto - t, scratch.data());
        t = upto;
      };
      for (const auto& [after, slot] : outs) {
        run(after + 1);
        for (int64_t i = 0; i < dk; ++i)
          from_float(S.data() + i * group_cols, sp + slot * ps0 + h * ps1 + i * ps2 + c0, ncols);
      }
      run(len);  // tokens after the last store point still produce outputs
    }
  });
  return o;
}

// Short causal depthwise conv + SiLU for a whole batch: x [T, C], weight [C, K]; pool [N, C, K-1] holds each
// slot's last K-1 pre-conv inputs (oldest first), read from state_in and stored per the schedule above (the
// window after the token a store point names). Returns [T, C] in x's dtype, zeros outside every request.
// A task is (request, block of kLanes channels): the block's window is K-1 vectors, one per tap, shifted along as
// the tokens pass, so each token costs K vector multiply-adds and a SiLU for kLanes channels. Each channel's sum
// runs over its taps in order, oldest first, then the new input. 2,048 tokens of 1,536 channels, one Zen 5 core:
// 3.7 ms against 19-21 ms one channel at a time (avx512 and avx2 builds alike; portable 11 against 20), which was
// more than the layer's chunked KDA took.
at::Tensor causal_conv1d_varlen(const at::Tensor& x_, const at::Tensor& weight_, at::Tensor& pool,
                                const at::Tensor& cu_seqlens, const at::Tensor& state_in,
                                const at::Tensor& state_out, const at::Tensor& state_out_at) {
  TORCH_CHECK(x_.dim() == 2 && pool.dim() == 3, "causal_conv1d_varlen: x [T, C], pool [N, C, K-1]");
  const int64_t T = x_.size(0), C = x_.size(1), K = weight_.size(-1);
  TORCH_CHECK(K >= 2, "causal_conv1d_varlen: kernel width must be at least 2");
  TORCH_CHECK(pool.size(1) == C && pool.size(2) == K - 1, "causal_conv1d_varlen: pool must be [N, C, K-1]");
  constexpr int kMaxTaps = 16;
  TORCH_CHECK(K - 1 <= kMaxTaps, "causal_conv1d_varlen: kernel width above ", kMaxTaps + 1);
  const at::Tensor x = x_.stride(1) == 1 ? x_ : x_.contiguous();  // channel vectors are loaded whole
  const at::Tensor weight = weight_.reshape({C, K}).to(at::kFloat).contiguous();
  // tap-major weights ([K, C]), once per call: a task loads its block's taps as vectors
  std::vector<float> taps(K * C);
  const float* w_ck = weight.data_ptr<float>();
  for (int64_t j = 0; j < K; ++j)
    for (int64_t c = 0; c < C; ++c) taps[j * C + c] = w_ck[c * K + j];
  at::Tensor cu = as_long(cu_seqlens), in = as_long(state_in), out = as_long(state_out), at_ = as_long(state_out_at);
  const StateSchedule sched = check_schedule(cu, in, out, at_, T, pool.size(0), "causal_conv1d_varlen");
  const int64_t R = in.numel();
  at::Tensor y = at::zeros({T, C}, x.options());
  const float* w = taps.data();
  const int64_t s0 = pool.stride(0), s1 = pool.stride(1), s2 = pool.stride(2), sx = x.stride(0), sy = y.stride(0);
  const int64_t n_blocks = (C + kLanes - 1) / kLanes;
  const int nw = static_cast<int>(K - 1);
  // Three pool layouts. Tap after tap (vLLM's "SD" conv-state layout, the model's view of it transposed:
  // channels contiguous, s1 == 1): each tap of a block is one vector, read and written in place. Channel after
  // channel ("DS", [C, K-1] contiguous): a block's windows are one run of m * nw values, read and written as vectors
  // and transposed in a float buffer, which costs more than the conv itself at one token. Anything else: value by
  // value.
  const bool taps_contiguous = s1 == 1;
  const bool packed = !taps_contiguous && s2 == 1 && s1 == nw;

  GLM53_DISPATCH_FLOAT_TYPES(x.scalar_type(), "conv_x", [&] {
    using x_t = scalar_t;
    GLM53_DISPATCH_FLOAT_TYPES(pool.scalar_type(), "conv_state", [&] {
      using s_t = scalar_t;
      const x_t* xp = x.data_ptr<x_t>();
      x_t* yp = y.data_ptr<x_t>();
      s_t* pp = pool.data_ptr<s_t>();
      at::parallel_for(0, R * n_blocks, 1, [&](int64_t begin, int64_t end) {
        std::vector<std::pair<int64_t, int64_t>> outs;
        int64_t outs_of = -1;                          // the request whose store points `outs` holds
        F16 win[kMaxTaps], tap[kMaxTaps + 1];
        alignas(64) float buf[kMaxTaps][kLanes];      // the block's window, tap-major
        alignas(64) float run[kMaxTaps * kLanes];     // the same, channel-major (the pool's order)
        for (int64_t task = begin; task < end; ++task) {
          const int64_t r = task / n_blocks, c0 = (task % n_blocks) * kLanes;
          const int64_t t0 = sched.cu[r], len = sched.cu[r + 1] - t0;
          if (len == 0) continue;
          const int m = static_cast<int>(std::min<int64_t>(kLanes, C - c0));
          const int n_run = m * nw;
          const int64_t slot_in = sched.in[r];
          if (slot_in < 0) {
            for (int j = 0; j < nw; ++j) win[j] = zero();
          } else if (taps_contiguous) {
            for (int j = 0; j < nw; ++j) win[j] = load(pp + slot_in * s0 + j * s2 + c0, m);
          } else if (packed) {
            const s_t* src = pp + slot_in * s0 + c0 * nw;
            for (int q = 0; q < n_run; q += kLanes) store(run + q, load(src + q, std::min(kLanes, n_run - q)));
            for (int j = 0; j < nw; ++j) {
              for (int i = 0; i < kLanes; ++i) buf[j][i] = i < m ? run[i * nw + j] : 0.0f;
              win[j] = load(buf[j]);
            }
          } else {
            for (int j = 0; j < nw; ++j) {
              for (int i = 0; i < kLanes; ++i)
                buf[j][i] = i < m ? static_cast<float>(pp[slot_in * s0 + (c0 + i) * s1 + j * s2]) : 0.0f;
              win[j] = load(buf[j]);
            }
          }
          for (int j = 0; j <= nw; ++j) tap[j] = load(w + j * C + c0, m);
          if (outs_of != r) {
            sched.sorted_outputs(r, outs);
            outs_of = r;
          }
          size_t next = 0;
          for (int64_t t = 0; t < len; ++t) {
            const F16 xv = load(xp + (t0 + t) * sx + c0, m);
            F16 a = zero();
            for (int j = 0; j < nw; ++j) a = fma(win[j], tap[j], a);
            a = fma(xv, tap[nw], a);
            for (int j = 0; j + 1 < nw; ++j) win[j] = win[j + 1];
            win[nw - 1] = xv;
            store(yp + (t0 + t) * sy + c0, a / (set1(1.0f) + exp(zero() - a)), m);  // SiLU
            while (next < outs.size() && outs[next].first == t) {
              const int64_t slot = outs[next++].second;
              if (taps_contiguous) {
                for (int j = 0; j < nw; ++j) store(pp + slot * s0 + j * s2 + c0, win[j], m);
                continue;
              }
              for (int j = 0; j < nw; ++j) store(buf[j], win[j]);
              if (packed) {
                for (int i = 0; i < m; ++i)
                  for (int j = 0; j < nw; ++j) run[i * nw + j] = buf[j][i];
                s_t* dst = pp + slot * s0 + c0 * nw;
                for (int q = 0; q < n_run; q += kLanes) store(dst + q, load(run + q), std::min(kLanes, n_run - q));
              } else {
                for (int i = 0; i < m; ++i)
                  for (int j = 0; j < nw; ++j) pp[slot * s0 + (c0 + i) * s1 + j * s2] = static_cast<s_t>(buf[j][i]);
              }
            }
          }
        }
      });
    });
  });
  return y;
}

}  // namespace glm53
