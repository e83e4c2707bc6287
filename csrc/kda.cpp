// KDA (Kimi Delta Attention) on CPU: the fused decode step, the prefill recurrence and the decode-time short
// convolution. Same maths and layouts as vllm_glm53/backends/cpu/kda.py (state [H, dk, dv] float32, key-major).
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
// (row stride ``ldS``), ``ncols`` <= NV * 16 valid columns. ``scratch`` holds 3 * dk floats.
template <int NV>
void recur_group(float* S, int64_t ldS, int64_t dk, int ncols, const HeadInputs& in, int64_t n_tok,
                 float* scratch) {
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

void run_group(float* S, int64_t ldS, int64_t dk, int ncols, const HeadInputs& in, int64_t n_tok, float* scratch) {
  switch ((ncols + kLanes - 1) / kLanes) {
    case 1: return recur_group<1>(S, ldS, dk, ncols, in, n_tok, scratch);
    case 2: return recur_group<2>(S, ldS, dk, ncols, in, n_tok, scratch);
    case 3: return recur_group<3>(S, ldS, dk, ncols, in, n_tok, scratch);
    default: return recur_group<kGroupVecs>(S, ldS, dk, ncols, in, n_tok, scratch);
  }
}

at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "kda: ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), "kda: ", name, " must be on the CPU");
}

}  // namespace

// q, k, g [B, H, dk], v [B, H, dv], beta [B, H] float32. ``state`` is [B, H, dk, dv] float32, or with ``slots``
// [B] a pool [N, H, dk, dv] whose rows slots[b] are the sequences' states (any slot/head strides, rows
// contiguous). Updated in place; slots < 0 (padding) are skipped and give zeros. Returns o [B, H, dv] float32.
at::Tensor kda_decode_step(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& g_,
                           const at::Tensor& beta_, at::Tensor& state, const std::optional<at::Tensor>& slots_) {
  for (const at::Tensor* p : {&q_, &k_, &v_, &g_, &beta_, static_cast<const at::Tensor*>(&state)})
    check_f32(*p, "inputs and state");
  at::Tensor q = last_dim_contiguous(q_), k = last_dim_contiguous(k_), v = last_dim_contiguous(v_),
             g = last_dim_contiguous(g_), beta = beta_;
  const int64_t B = q.size(0), H = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(k.sizes() == q.sizes() && g.sizes() == q.sizes(), "kda_decode_step: q, k, g shapes differ");
  TORCH_CHECK(v.size(0) == B && v.size(1) == H && beta.size(0) == B && beta.size(1) == H,
              "kda_decode_step: v / beta shapes do not match q");
  TORCH_CHECK(state.dim() == 4 && state.size(1) == H && state.size(2) == dk && state.size(3) == dv,
              "kda_decode_step: state must be [*, H, dk, dv]");
  TORCH_CHECK(state.stride(3) == 1, "kda_decode_step: state rows must be contiguous");
  at::Tensor slots;
  if (slots_.has_value()) {
    slots = slots_->to(at::kLong).contiguous();
    TORCH_CHECK(slots.numel() == B, "kda_decode_step: need one slot per sequence");
  } else {
    TORCH_CHECK(state.size(0) == B, "kda_decode_step: state batch differs from q");
  }
  const int64_t* slot_ptr = slots.defined() ? slots.data_ptr<int64_t>() : nullptr;
  const int64_t n_slots = state.size(0);

  at::Tensor o = at::empty({B, H, dv}, q.options());
  const int64_t group_cols = kGroupVecs * kLanes;
  const int64_t n_groups = (dv + group_cols - 1) / group_cols;
  float* sp = state.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *gp = g.data_ptr<float>(),
              *vp = v.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = o.data_ptr<float>();

  at::parallel_for(0, B * H * n_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(3 * dk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (H * n_groups), h = (task / n_groups) % H, grp = task % n_groups;
      const int64_t c0 = grp * group_cols;
      const int ncols = static_cast<int>(std::min(group_cols, dv - c0));
      const int64_t slot = slot_ptr ? slot_ptr[b] : b;
      float* o_bh = op + b * o.stride(0) + h * o.stride(1) + c0;
      if (slot < 0) {
        std::fill(o_bh, o_bh + ncols, 0.0f);
        continue;
      }
      TORCH_CHECK(slot < n_slots, "kda_decode_step: slot ", slot, " outside the state pool of ", n_slots);
      HeadInputs in{qp + b * q.stride(0) + h * q.stride(1),
                    kp + b * k.stride(0) + h * k.stride(1),
                    gp + b * g.stride(0) + h * g.stride(1),
                    vp + b * v.stride(0) + h * v.stride(1) + c0,
                    bp + b * beta.stride(0) + h * beta.stride(1),
                    0, 0, 0, 0, 0,
                    o_bh,
                    0};
      float* S = sp + slot * state.stride(0) + h * state.stride(1) + c0;
      run_group(S, state.stride(2), dk, ncols, in, 1, scratch.data());
    }
  });
  return o;
}

// One sequence: q, k, g [T, H, dk], v [T, H, dv], beta [T, H] float32, initial_state [H, dk, dv] or None (zeros).
// Returns (o [T, H, dv], final state [H, dk, dv]) float32; the initial state is not modified.
std::tuple<at::Tensor, at::Tensor> kda_prefill(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                               const at::Tensor& g_, const at::Tensor& beta,
                                               const std::optional<at::Tensor>& initial_state) {
  for (const at::Tensor* p : {&q_, &k_, &v_, &g_, &beta}) check_f32(*p, "inputs");
  at::Tensor q = last_dim_contiguous(q_), k = last_dim_contiguous(k_), v = last_dim_contiguous(v_),
             g = last_dim_contiguous(g_);
  const int64_t T = q.size(0), H = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(k.sizes() == q.sizes() && g.sizes() == q.sizes(), "kda_prefill: q, k, g shapes differ");
  TORCH_CHECK(v.size(0) == T && v.size(1) == H && beta.size(0) == T && beta.size(1) == H,
              "kda_prefill: v / beta shapes do not match q");
  at::Tensor state;
  if (initial_state.has_value()) {
    TORCH_CHECK(initial_state->sizes() == at::IntArrayRef({H, dk, dv}), "kda_prefill: state must be [H, dk, dv]");
    state = initial_state->to(at::kFloat).clone(at::MemoryFormat::Contiguous);
  } else {
    state = at::zeros({H, dk, dv}, q.options());
  }
  at::Tensor o = at::empty({T, H, dv}, q.options());
  if (T == 0) return {o, state};

  const int64_t group_cols = kGroupVecs * kLanes;
  const int64_t n_groups = (dv + group_cols - 1) / group_cols;
  float* sp = state.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *gp = g.data_ptr<float>(),
              *vp = v.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = o.data_ptr<float>();

  // Each (head, column group) is an independent recurrence over the whole sequence.
  at::parallel_for(0, H * n_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(3 * dk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / n_groups, c0 = (task % n_groups) * group_cols;
      const int ncols = static_cast<int>(std::min(group_cols, dv - c0));
      HeadInputs in{qp + h * q.stride(1), kp + h * k.stride(1), gp + h * g.stride(1),
                    vp + h * v.stride(1) + c0, bp + h * beta.stride(1),
                    q.stride(0), k.stride(0), g.stride(0), v.stride(0), beta.stride(0),
                    op + h * o.stride(1) + c0, o.stride(0)};
      run_group(sp + h * dk * dv + c0, dv, dk, ncols, in, T, scratch.data());
    }
  });
  return {o, state};
}

// Short causal depthwise conv for one decode token per sequence, then SiLU. x [B, C], weight [C, K];
// ``state`` [B, C, K-1] (or a pool [N, C, K-1] addressed by ``slots``) holds the last K-1 inputs, oldest first,
// and is shifted in place. Returns [B, C] in x's dtype.
at::Tensor causal_conv1d_update(const at::Tensor& x, const at::Tensor& weight_, at::Tensor& state,
                                const std::optional<at::Tensor>& slots_) {
  TORCH_CHECK(x.dim() == 2 && state.dim() == 3, "causal_conv1d_update: x [B, C], state [*, C, K-1]");
  const int64_t B = x.size(0), C = x.size(1), K = weight_.size(-1);
  TORCH_CHECK(state.size(1) == C && state.size(2) == K - 1, "causal_conv1d_update: state must be [*, C, K-1]");
  at::Tensor weight = weight_.reshape({C, K}).to(at::kFloat).contiguous();
  at::Tensor slots;
  if (slots_.has_value()) {
    slots = slots_->to(at::kLong).contiguous();
    TORCH_CHECK(slots.numel() == B, "causal_conv1d_update: need one slot per sequence");
  } else {
    TORCH_CHECK(state.size(0) == B, "causal_conv1d_update: state batch differs from x");
  }
  const int64_t* slot_ptr = slots.defined() ? slots.data_ptr<int64_t>() : nullptr;
  at::Tensor out = at::empty({B, C}, x.options());
  const float* w = weight.data_ptr<float>();
  const int64_t s0 = state.stride(0), s1 = state.stride(1), s2 = state.stride(2);
  const int64_t n_slots = state.size(0);

  GLM53_DISPATCH_FLOAT_TYPES(x.scalar_type(), "conv_x", [&] {
    using x_t = scalar_t;
    GLM53_DISPATCH_FLOAT_TYPES(state.scalar_type(), "conv_state", [&] {
      using s_t = scalar_t;
      const x_t* xp = x.data_ptr<x_t>();
      x_t* outp = out.data_ptr<x_t>();
      s_t* stp = state.data_ptr<s_t>();
      at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
        float y[kLanes];
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t slot = slot_ptr ? slot_ptr[b] : b;
          x_t* ob = outp + b * out.stride(0);
          if (slot < 0) {
            std::fill(ob, ob + C, x_t(0));
            continue;
          }
          TORCH_CHECK(slot < n_slots, "causal_conv1d_update: slot ", slot, " outside the pool of ", n_slots);
          s_t* st = stp + slot * s0;
          for (int64_t c0 = 0; c0 < C; c0 += kLanes) {
            const int m = static_cast<int>(std::min<int64_t>(kLanes, C - c0));
            for (int i = 0; i < m; ++i) {
              const int64_t c = c0 + i;
              s_t* sc = st + c * s1;
              const float* wc = w + c * K;
              const float xc = static_cast<float>(xp[b * x.stride(0) + c * x.stride(1)]);
              float acc = 0.0f;
              for (int64_t j = 0; j < K - 1; ++j) acc += static_cast<float>(sc[j * s2]) * wc[j];
              y[i] = acc + xc * wc[K - 1];
              for (int64_t j = 0; j + 1 < K - 1; ++j) sc[j * s2] = sc[(j + 1) * s2];
              if (K > 1) sc[(K - 2) * s2] = static_cast<s_t>(xc);
            }
            // SiLU for the lane group at once: y / (1 + exp(-y)).
            F16 yv = load(y, m);
            store(y, yv / (set1(1.0f) + exp(zero() - yv)), m);
            for (int i = 0; i < m; ++i) ob[c0 + i] = static_cast<x_t>(y[i]);
          }
        }
      });
    });
  });
  return out;
}

}  // namespace glm53
