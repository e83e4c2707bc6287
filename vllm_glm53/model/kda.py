"""KDA (Kimi Delta Attention) layer: GLM-5.3's linear-attention block (architecture.md §5).

A vLLM hybrid-state layer: each running sequence owns one state slot holding the short-conv window and the
float32 recurrent state (speculative decoding: one slot per draft position). The layer is its projections plus
one registered custom op, ``torch.ops.vllm_glm53_layers.kda_recurrence``, that runs the short conv and the delta
rule for the whole batch, decodes, prefills, prefill chunks and draft verification alike, on the state pools as
the step plan says (:class:`~vllm_glm53.backends.plans.StateSlots`, built once per step by
:mod:`vllm_glm53.backends.kda_state` over vLLM's GDN metadata). The maths is the platform's KDA ops.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_glm53 import _vllm
from vllm_glm53._vllm import (
    ColumnParallelLinear,
    MambaBase,
    MergedColumnParallelLinear,
    RowParallelLinear,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm_glm53.backends import kda_ops
from vllm_glm53.backends.kda_state import KDAStateBackend
from vllm_glm53.backends.plans import StateSlots
from vllm_glm53.config import TextArch
from vllm_glm53.model.layer_ops import forward_layer, register_layer_op
from vllm_glm53.quant.plan import layer_quant


def kda_state_shapes(arch: TextArch, tp_size: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv state, recurrent state) per sequence on one TP rank: the last K-1 pre-conv q|k|v inputs of this
    rank's channels in vLLM's conv-state layout (``[K-1, C]`` tap after tap, or ``[C, K-1]``), and the key-major
    ``[heads, dk, dv]`` delta-rule state."""
    heads = arch.linear_num_heads // tp_size
    d = arch.linear_head_dim
    C, taps = 3 * heads * d, arch.conv_kernel - 1
    return ((taps, C) if _vllm.conv_state_taps_first() else (C, taps)), (heads, d, d)


def conv_windows(pool: torch.Tensor, taps_first: bool) -> torch.Tensor:
    """The conv-state pool as the ops read it, ``[N, C, K-1]`` whatever vLLM's layout (a view: the ops follow its
    strides; tap after tap, each tap of a block of channels is one vector load)."""
    return pool.transpose(1, 2) if taps_first else pool


def kda_state_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    # The conv window holds activations (model dtype); the recurrent state accumulates over the whole
    # sequence and stays float32 as in the reference.
    return model_dtype, torch.float32


class Glm5NextKDA(nn.Module, MambaBase):
    def __init__(self, arch: TextArch, layer_idx: int, model_dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        if arch.linear_num_heads % tp:
            raise ValueError(f"linear_num_heads {arch.linear_num_heads} is not divisible by TP {tp}")
        self.arch = arch
        self.prefix = prefix
        self.model_dtype = model_dtype
        self.tp_size, self.tp_rank = tp, get_tensor_model_parallel_rank()
        H, d, D = arch.linear_num_heads, arch.linear_head_dim, arch.hidden_size
        self.heads = H // tp
        self.head_dim = d
        proj = H * d
        qc = layer_quant()  # the checkpoint's quantized projections, if any (GLM-5.3 stores KDA in BF16)

        # q | k | v and the per-head beta logits b, all split by head over TP ranks: one GEMM.
        self.qkvb_proj = MergedColumnParallelLinear(D, [proj] * 3 + [H], bias=False, quant_config=qc,
                                                    prefix=f"{prefix}.qkvb_proj")
        # Checkpoint q/k/v_conv1d.weight [H*d, 1, K] each; this rank keeps its heads' channels, q|k|v order.
        self.conv_weight = nn.Parameter(torch.empty(3 * self.heads * d, arch.conv_kernel, dtype=torch.float32),
                                        requires_grad=False)
        # The low-rank first halves of the forget gate and the output gate read the same hidden state: one GEMM
        # (rows f_a | g_a), replicated like the two it replaces.
        self.fg_a_proj = MergedColumnParallelLinear(D, [d, d], bias=False, quant_config=qc, disable_tp=True,
                                                    prefix=f"{prefix}.fg_a_proj")
        self.f_b_proj = ColumnParallelLinear(d, proj, bias=False, quant_config=qc, prefix=f"{prefix}.f_b_proj")
        self.dt_bias = nn.Parameter(torch.empty(self.heads * d, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.g_b_proj = ColumnParallelLinear(d, proj, bias=False, quant_config=qc, prefix=f"{prefix}.g_b_proj")
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(d), requires_grad=False)
        self.o_proj = RowParallelLinear(proj, D, bias=False, quant_config=qc, prefix=f"{prefix}.o_proj")

        vllm_config = _vllm.get_current_vllm_config()
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name {prefix}")
        ctx[prefix] = self
        self.kv_cache: tuple[torch.Tensor, ...] = ()
        self.conv_taps_first = _vllm.conv_state_taps_first()  # the layout kda_state_shapes gave vLLM

    # --- vLLM hybrid-state interface -------------------------------------------------------------------

    def get_state_shape(self):
        return kda_state_shapes(self.arch, self.tp_size)

    def get_state_dtype(self):
        return kda_state_dtypes(self.model_dtype)

    @property
    def mamba_type(self):
        return _vllm.MambaAttentionBackendEnum.GDN_ATTN

    def get_attn_backend(self):
        # GDN's metadata (slot per request, decode-first order, initial-state flags, speculative slots) is what
        # a delta-rule layer needs from the scheduler; this backend adds the step plan the ops read.
        return KDAStateBackend

    # --- weights -----------------------------------------------------------------------------------------

    def load_conv(self, which: int, weight: torch.Tensor) -> None:
        """Checkpoint ``{q,k,v}_conv1d.weight`` ([H*d, 1, K]) -> this rank's rows of ``conv_weight``."""
        n = self.heads * self.head_dim
        lo = self.tp_rank * n
        self.conv_weight.data[which * n : (which + 1) * n].copy_(weight.reshape(weight.shape[0], -1)[lo : lo + n])

    def load_sharded_vector(self, param: nn.Parameter, weight: torch.Tensor) -> None:
        n = param.shape[0]
        param.data.copy_(weight[self.tp_rank * n : (self.tp_rank + 1) * n])

    # --- forward -------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        H, d = self.heads, self.head_dim
        qkvb, _ = self.qkvb_proj(x)
        qkv, b = qkvb.split([3 * H * d, H], dim=-1)
        fg_a, _ = self.fg_a_proj(x)
        fa, ga = fg_a.split([d, d], dim=-1)
        a, _ = self.f_b_proj(fa)
        g = kda_ops.kda_gate((a.float() + self.dt_bias).view(T, H, d), self.A_log, self.arch.gate_lower_bound)
        beta = torch.sigmoid(b.float())
        gate, _ = self.g_b_proj(ga)

        core = _kda_recurrence(qkv, g, beta, self.prefix)  # [T, H, d] float32
        o = kda_ops.gated_rmsnorm(core, gate.view(T, H, d), self.o_norm.weight, self.arch.rms_norm_eps,
                                  out_dtype=x.dtype)
        out, _ = self.o_proj(o.reshape(T, H * d))
        return out

    def recurrence(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """Short conv + delta rule for the whole batch, reading and writing the state slots the step plan names
        (profiling and dummy runs carry no plan: one fresh sequence whose state is not kept)."""
        meta = _vllm.layer_attn_metadata(self.prefix)
        T = qkv.shape[0]
        if meta is None:
            plan = StateSlots.fresh(T, qkv.device)
            conv_pool = qkv.new_empty(0, *kda_state_shapes(self.arch, self.tp_size)[0])
            state_pool = torch.empty(0, self.heads, self.head_dim, self.head_dim, device=qkv.device)
        else:
            plan = meta.plan
            conv_pool, state_pool = self.kv_cache
        y = kda_ops.causal_conv1d_varlen(qkv, self.conv_weight, conv_windows(conv_pool, self.conv_taps_first), plan)
        q, k, v = y.view(T, 3, self.heads, self.head_dim).unbind(1)
        q, k = kda_ops.l2norm_qk(q, k, self.head_dim)
        return kda_ops.kda_varlen(q, k, v.to(torch.float32), g, beta, state_pool, plan)


def _kda_recurrence_impl(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, layer_name: str) -> torch.Tensor:
    return forward_layer(layer_name).recurrence(qkv, g, beta)


def _kda_recurrence_fake(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty(qkv.shape[0], g.shape[1], g.shape[2], dtype=torch.float32, device=qkv.device)


_kda_recurrence = register_layer_op("kda_recurrence", _kda_recurrence_impl, _kda_recurrence_fake)
