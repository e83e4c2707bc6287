"""KDA (Kimi Delta Attention) layer: GLM-5.3's linear-attention block (architecture.md §5).

A vLLM hybrid-state layer: each running sequence owns one state slot holding the short-conv window and the
float32 recurrent state. Slots and batch layout come from vLLM's GDN metadata (its builder is plain torch
and already handles decode-first ordering, initial-state flags and speculative slots), the maths from the
platform's KDA backend.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_glm53 import _vllm
from vllm_glm53._vllm import (
    ColumnParallelLinear,
    MambaBase,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm_glm53.backends import kda_ops
from vllm_glm53.config import TextArch
from vllm_glm53.quant.plan import layer_quant


def kda_state_shapes(arch: TextArch, tp_size: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv state, recurrent state) per sequence on one TP rank: the last K-1 pre-conv q|k|v inputs of this
    rank's channels, and the key-major ``[heads, dk, dv]`` delta-rule state."""
    heads = arch.linear_num_heads // tp_size
    d = arch.linear_head_dim
    return (3 * heads * d, arch.conv_kernel - 1), (heads, d, d)


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

        self.qkv_proj = MergedColumnParallelLinear(D, [proj] * 3, bias=False, quant_config=qc,
                                                   prefix=f"{prefix}.qkv_proj")
        # Checkpoint q/k/v_conv1d.weight [H*d, 1, K] each; this rank keeps its heads' channels, q|k|v order.
        self.conv_weight = nn.Parameter(torch.empty(3 * self.heads * d, arch.conv_kernel, dtype=torch.float32),
                                        requires_grad=False)
        self.f_a_proj = ReplicatedLinear(D, d, bias=False, quant_config=qc, prefix=f"{prefix}.f_a_proj")
        self.f_b_proj = ColumnParallelLinear(d, proj, bias=False, quant_config=qc, prefix=f"{prefix}.f_b_proj")
        self.dt_bias = nn.Parameter(torch.empty(self.heads * d, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.b_proj = ColumnParallelLinear(D, H, bias=False, quant_config=qc, prefix=f"{prefix}.b_proj")
        self.g_a_proj = ReplicatedLinear(D, d, bias=False, quant_config=qc, prefix=f"{prefix}.g_a_proj")
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

    # --- vLLM hybrid-state interface -------------------------------------------------------------------

    def get_state_shape(self):
        return kda_state_shapes(self.arch, self.tp_size)

    def get_state_dtype(self):
        return kda_state_dtypes(self.model_dtype)

    @property
    def mamba_type(self):
        return _vllm.MambaAttentionBackendEnum.GDN_ATTN

    def get_attn_backend(self):
        # GDN's metadata (slot per request, decode-first order, initial-state flags) is exactly what a
        # delta-rule layer needs; the compute below is ours.
        return _vllm.GDNAttentionBackend

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
        qkv, _ = self.qkv_proj(x)
        fa, _ = self.f_a_proj(x)
        a, _ = self.f_b_proj(fa)
        g = kda_ops.kda_gate((a.float() + self.dt_bias).view(T, H, d), self.A_log, self.arch.gate_lower_bound)
        b, _ = self.b_proj(x)
        beta = torch.sigmoid(b.float())
        ga, _ = self.g_a_proj(x)
        gate, _ = self.g_b_proj(ga)

        core = self._recurrence(qkv, g, beta)  # [T, H, d] float32
        o = kda_ops.gated_rmsnorm(core, gate.view(T, H, d), self.o_norm.weight, self.arch.rms_norm_eps,
                                  out_dtype=x.dtype)
        out, _ = self.o_proj(o.reshape(T, H * d))
        return out

    def _recurrence(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """Short conv + delta rule for the whole batch, reading and writing the per-sequence state slots."""
        meta = _vllm.layer_attn_metadata(self.prefix)
        T = qkv.shape[0]
        out = torch.empty(T, self.heads, self.head_dim, dtype=torch.float32, device=qkv.device)
        if meta is None:  # profiling / dummy run: one fresh sequence, nothing kept
            out[:] = self._prefill(qkv, g, beta, None, None)
            return out
        if meta.num_spec_decodes:
            # With drafts in the batch, vLLM lists the draft-verifying tokens and the others separately.
            spec = meta.spec_token_indx.long()
            out[spec] = self._verify_drafts(qkv[spec], g[spec], beta[spec], meta)
            if meta.num_prefills or meta.num_decodes:
                rest = meta.non_spec_token_indx.long()
                out[rest] = self._plain(qkv[rest], g[rest], beta[rest], meta)
        else:
            n = meta.num_actual_tokens
            out[:n] = self._plain(qkv[:n], g[:n], beta[:n], meta)
        return out

    def _plain(self, qkv, g, beta, meta) -> torch.Tensor:
        """Single-token decodes (first in the batch) and prefills, one state slot per sequence."""
        out = torch.empty(qkv.shape[0], self.heads, self.head_dim, dtype=torch.float32, device=qkv.device)
        conv_pool, state_pool = self.kv_cache
        slots = meta.non_spec_state_indices_tensor
        qsl = meta.non_spec_query_start_loc.tolist()
        nd = meta.num_decodes
        if nd:  # updated in place in the pools: each state is read and written once
            slot = slots[:nd]
            y = kda_ops.causal_conv1d_update_slots(qkv[:nd], self.conv_weight, conv_pool, slot)
            q, k, v = self._split(y)
            out[:nd] = kda_ops.kda_decode_step_slots(q, k, v, g[:nd], beta[:nd], state_pool, slot)
        has_init = meta.has_initial_state
        for r in range(nd, nd + meta.num_prefills):
            lo, hi = qsl[r], qsl[r + 1]
            slot = int(slots[r])
            if has_init is not None and bool(has_init[r]):
                conv0, state0 = conv_pool[slot], state_pool[slot]
            else:
                conv0 = state0 = None
            out[lo:hi] = self._prefill(qkv[lo:hi], g[lo:hi], beta[lo:hi], conv0, state0, slot)
        return out

    def _verify_drafts(self, qkv, g, beta, meta) -> torch.Tensor:
        """Tokens that verify speculative drafts. Each such sequence owns ``1 + num_speculative_tokens`` state
        slots: the step starts from the slot of its last accepted token (``num_accepted_tokens - 1``) and the
        state after its i-th token goes to slot i, so whatever the sampler accepts, the next step finds the
        state right after the last accepted token without recomputing anything."""
        conv_pool, state_pool = self.kv_cache
        n = meta.num_spec_decodes
        slots = meta.spec_state_indices_tensor[:n].long()
        qsl = meta.spec_query_start_loc[: n + 1].tolist()
        lens = [qsl[j + 1] - qsl[j] for j in range(n)]
        accepted = meta.num_accepted_tokens[:n].long()
        start = slots[torch.arange(n), accepted - 1]
        conv, state = conv_pool[start], state_pool[start]  # working copies, one per sequence
        out = torch.empty(qkv.shape[0], self.heads, self.head_dim, dtype=torch.float32, device=qkv.device)
        for i in range(max(lens)):
            rows = torch.tensor([j for j in range(n) if lens[j] > i], dtype=torch.long)
            tok = torch.tensor([qsl[j] + i for j in rows.tolist()], dtype=torch.long)
            c, s = conv[rows], state[rows]
            y = kda_ops.causal_conv1d_update(qkv[tok], self.conv_weight, c)
            q, k, v = self._split(y)
            out[tok] = kda_ops.kda_decode_step(q, k, v, g[tok], beta[tok], s)
            conv[rows], state[rows] = c, s
            dst = slots[rows, i]
            conv_pool[dst], state_pool[dst] = c, s
        return out

    def _prefill(self, qkv, g, beta, conv0, state0, slot: int | None = None) -> torch.Tensor:
        y, conv1 = kda_ops.causal_conv1d(qkv, self.conv_weight, conv0)
        q, k, v = self._split(y)
        o, state1 = kda_ops.kda_chunked(q, k, v, g, beta, initial_state=state0)
        if slot is not None:
            conv_pool, state_pool = self.kv_cache
            conv_pool[slot] = conv1
            state_pool[slot] = state1
        return o

    def _split(self, y: torch.Tensor):
        """Conv output [N, 3*H*d] -> L2-normalised, scaled q and k, and v, each [N, H, d] float32."""
        N = y.shape[0]
        q, k, v = y.view(N, 3, self.heads, self.head_dim).unbind(1)
        q, k = kda_ops.l2norm_qk(q, k, self.head_dim)
        return q, k, v.to(torch.float32)

