"""GLM-5.3 vision tower and projector (architecture.md §11.2), built from vLLM's tensor-parallel layers.

    patches [N, C·T·P·P] (processor layout: 2×2 merge windows in raster order, the 4 patches of a window
    in raster order)
      -> patch embedding (the checkpoint's Conv3d with stride = kernel, i.e. a linear map of each patch)
      -> depth × [x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x))], attention bidirectional within each frame
         (each temporal patch of a video is its own frame), 2-D axial RoPE on q and k
      -> RMSNorm -> 2×2 downsample (the checkpoint's Conv2d, a linear map of each window's 4 patches)
      -> projector: Linear -> LayerNorm -> exact GELU -> clamped SwiGLU MLP
      = [N/4, text hidden] rows that replace the ``<|image|>`` placeholder embeddings one for one.

Tensor parallelism: attention heads (qkv, proj) and the two SwiGLU MLPs are split over the TP ranks; the
patch embedding, downsample and projector input map are small and replicated.

Norm epsilon (the [Δ] of architecture.md §11.2): every RMSNorm here — block norms, per-head q/k norms and
the post-layernorm — uses ``vision_config.rms_norm_eps``, as transformers 5.19 (the numerical reference)
does. vLLM 0.32's in-tree model forces 1e-6 on the block norms ("the trained value"); if the released
checkpoint turns out to need that, set ``rms_norm_eps`` in its ``vision_config`` rather than special-casing
it here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_glm53._vllm import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
    divide,
    get_tensor_model_parallel_world_size,
)
from vllm_glm53.model.moe_routing import clamped_swiglu
from vllm_glm53.model.norm import RMSNorm
from vllm_glm53.model.weights import CheckpointError

GridTHW = Sequence[Sequence[int]]  # per item: (temporal patches, patch rows, patch cols)


@dataclass(frozen=True)
class VisionArch:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    out_hidden_size: int
    projection_intermediate_size: int
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float
    bias: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_area(self) -> int:
        return self.merge_size**2


def vision_arch(hf_config: Any) -> VisionArch:
    """The vision config of a nested ``glm5_next`` config, validated against the text model it feeds."""
    v = hf_config.vision_config
    text = getattr(hf_config, "text_config", None) or hf_config
    rope = getattr(v, "rope_parameters", None) or {}
    swiglu_limit = getattr(v, "swiglu_limit", None)
    arch = VisionArch(
        depth=int(v.depth),
        hidden_size=int(v.hidden_size),
        num_heads=int(v.num_heads),
        intermediate_size=int(v.intermediate_size),
        patch_size=int(v.patch_size),
        temporal_patch_size=int(v.temporal_patch_size),
        merge_size=int(v.spatial_merge_size),
        in_channels=int(v.in_channels),
        out_hidden_size=int(v.out_hidden_size),
        projection_intermediate_size=int(v.projection_intermediate_size),
        swiglu_limit=float(text.swiglu_limit if swiglu_limit is None else swiglu_limit),
        rms_norm_eps=float(v.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        bias=bool(getattr(v, "attention_bias", True)),
    )
    problems = []
    if arch.out_hidden_size != int(text.hidden_size):
        problems.append(f"vision_config.out_hidden_size ({arch.out_hidden_size}) must equal the text hidden_size "
                        f"({text.hidden_size}): projected image features replace token embeddings one for one")
    if arch.hidden_size % arch.num_heads or arch.head_dim % 4:
        problems.append("vision hidden_size / num_heads must be a multiple of 4 (two axes of rotary pairs)")
    if rope.get("rope_type", "axial") != "axial":
        problems.append(f"vision rope_type {rope.get('rope_type')!r} is not supported (only 'axial')")
    if getattr(v, "hidden_act", "silu") != "silu":
        problems.append(f"vision hidden_act {v.hidden_act!r} is not supported (only 'silu')")
    if problems:
        raise CheckpointError("unsupported glm5_next vision config: " + "; ".join(problems))
    return arch


# ---------------------------------------------------------------------------------------------------------
# positions
# ---------------------------------------------------------------------------------------------------------


def patch_rows_cols(grid_thw: GridTHW, merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column index of every patch, in the processor's patch order (merge windows in raster order,
    patches within a window in raster order), repeated for each temporal patch."""
    rows, cols = [], []
    for t, h, w in grid_thw:
        m = merge_size
        r = torch.arange(h).view(h // m, 1, m, 1).expand(h // m, w // m, m, m)
        c = torch.arange(w).view(1, w // m, 1, m).expand(h // m, w // m, m, m)
        rows.append(r.reshape(-1).repeat(t))
        cols.append(c.reshape(-1).repeat(t))
    return torch.cat(rows), torch.cat(cols)


def axial_rope(rows: torch.Tensor, cols: torch.Tensor, head_dim: int,
               theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[N, head_dim]`` (float32) of the 2-D axial rotary embedding: ``head_dim/4`` frequencies
    ``θ^(-4k/head_dim)``, applied to the patch row for the first quarter of the dims and to the column for the
    second, repeated for the rotate-half partner dims."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2))
    angles = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over whole heads ``x [N, H, d]``, computed in float32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------------------


class VisionAttention(nn.Module):
    def __init__(self, a: VisionArch, prefix: str) -> None:
        super().__init__()
        self.qkv = QKVParallelLinear(a.hidden_size, a.head_dim, a.num_heads, a.num_heads, bias=a.bias,
                                     prefix=f"{prefix}.qkv")
        self.proj = RowParallelLinear(a.hidden_size, a.hidden_size, bias=a.bias, prefix=f"{prefix}.proj")
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.heads = divide(a.num_heads, get_tensor_model_parallel_world_size())
        self.head_dim = a.head_dim

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], frames: list[tuple[int, int]]):
        """``frames``: per item, (number of frames, patches per frame); attention never crosses a frame."""
        qkv, _ = self.qkv(x)
        q, k, v = qkv.view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        q = _rotate(self.q_norm(q), *rope)
        k = _rotate(self.k_norm(k), *rope)
        out, start = [], 0
        for n_frames, length in frames:
            end = start + n_frames * length
            # [frames, heads, patches, d]: the frames of one item share a length, so they batch.
            qf, kf, vf = (t[start:end].view(n_frames, length, self.heads, self.head_dim).transpose(1, 2)
                          for t in (q, k, v))
            o = F.scaled_dot_product_attention(qf, kf, vf)
            out.append(o.transpose(1, 2).reshape(n_frames * length, self.heads * self.head_dim))
            start = end
        y, _ = self.proj(torch.cat(out))
        return y


class VisionMLP(nn.Module):
    """Clamped SwiGLU ``down(silu(min(gate, L)) · clamp(up, ±L))``, split over TP ranks by width."""

    def __init__(self, dim: int, width: int, bias: bool, limit: float, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(dim, [width] * 2, bias=bias, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(width, dim, bias=bias, prefix=f"{prefix}.down_proj")
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        y, _ = self.down_proj(clamped_swiglu(gate_up, self.limit))
        return y


class VisionBlock(nn.Module):
    def __init__(self, a: VisionArch, prefix: str) -> None:
        super().__init__()
        self.norm1 = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.norm2 = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.attn = VisionAttention(a, prefix=f"{prefix}.attn")
        self.mlp = VisionMLP(a.hidden_size, a.intermediate_size, a.bias, a.swiglu_limit, prefix=f"{prefix}.mlp")

    def forward(self, x, rope, frames):
        x = x + self.attn(self.norm1(x), rope, frames)
        return x + self.mlp(self.norm2(x))


class Projector(nn.Module):
    """The "merger": maps each merged window into the text embedding space."""

    def __init__(self, a: VisionArch, prefix: str) -> None:
        super().__init__()
        d = a.out_hidden_size
        self.proj = ReplicatedLinear(d, d, bias=False, prefix=f"{prefix}.proj")
        self.post_projection_norm = nn.LayerNorm(d, eps=1e-5)
        self.mlp = VisionMLP(d, a.projection_intermediate_size, False, a.swiglu_limit, prefix=prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.proj(x)
        return self.mlp(F.gelu(self.post_projection_norm(x)))


class Glm5NextVisionTower(nn.Module):
    """Pixel patches of one modality batch -> one feature row per merged 2×2 window."""

    def __init__(self, arch: VisionArch, prefix: str = "visual") -> None:
        super().__init__()
        a = self.arch = arch
        self.patch_embed = ReplicatedLinear(a.patch_dim, a.hidden_size, bias=True, prefix=f"{prefix}.patch_embed")
        self.blocks = nn.ModuleList(VisionBlock(a, prefix=f"{prefix}.blocks.{i}") for i in range(a.depth))
        self.post_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.downsample = ReplicatedLinear(a.merge_area * a.hidden_size, a.out_hidden_size, bias=True,
                                           prefix=f"{prefix}.downsample")
        self.merger = Projector(a, prefix=f"{prefix}.merger")

    @property
    def dtype(self) -> torch.dtype:
        return self.post_layernorm.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> torch.Tensor:
        a = self.arch
        grid_thw = [tuple(int(v) for v in g) for g in grid_thw]
        expected = sum(t * h * w for t, h, w in grid_thw)
        if pixel_values.shape != (expected, a.patch_dim):
            raise ValueError(f"pixel values {tuple(pixel_values.shape)} do not match grids {grid_thw} "
                             f"({expected} patches of {a.patch_dim} values)")
        x, _ = self.patch_embed(pixel_values.to(self.dtype))
        rows, cols = patch_rows_cols(grid_thw, a.merge_size)
        rope = tuple(r.to(x.device) for r in axial_rope(rows, cols, a.head_dim, a.rope_theta))
        frames = [(t, h * w) for t, h, w in grid_thw]
        for block in self.blocks:
            x = block(x, rope, frames)
        x = self.post_layernorm(x)
        # A merge window is 4 consecutive patches; the downsample weight is stored to match that layout.
        x, _ = self.downsample(x.reshape(-1, a.merge_area * a.hidden_size))
        return self.merger(x)

    # --- checkpoint -----------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``model.visual.*`` tensors, names given relative to the tower; returns the parameters filled.

        Checkpoint layouts differ from the serving form in four places: the Conv3d patch embedding and
        Conv2d downsample become linear maps, ``qkv`` and the ``gate``/``up`` pairs are fused and sharded.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard, tensor = self._checkpoint_to_param(name, tensor)
            param = params.get(target)
            if param is None:
                raise CheckpointError(f"unexpected vision tensor model.visual.{name} {tuple(tensor.shape)}")
            try:
                if shard is None:
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                elif isinstance(shard, tuple):  # fused q|k|v on disk -> the three shards of QKVParallelLinear
                    for shard_id, part in zip(shard, tensor.chunk(3, dim=0)):
                        param.weight_loader(param, part, shard_id)
                else:
                    param.weight_loader(param, tensor, shard)
            except Exception as e:  # shape mismatch and friends: name the tensor
                raise CheckpointError(
                    f"cannot load vision tensor model.visual.{name} {tuple(tensor.shape)}: {e}") from e
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise CheckpointError(f"checkpoint lacks {len(missing)} vision tensors: "
                                  + ", ".join(f"model.visual.{n}" for n in missing[:12]))
        return loaded

    def _checkpoint_to_param(self, name: str, tensor: torch.Tensor):
        a = self.arch
        if name == "patch_embed.proj.weight":
            return "patch_embed.weight", None, tensor.reshape(a.hidden_size, a.patch_dim)
        if name == "patch_embed.proj.bias":
            return "patch_embed.bias", None, tensor
        if name == "downsample.weight":
            # Conv2d [out, C, m, m] -> rows over (window row, window col, channel), the order of a window's
            # 4 consecutive patch vectors.
            return name, None, tensor.permute(0, 2, 3, 1).reshape(a.out_hidden_size, -1)
        if name.endswith((".attn.qkv.weight", ".attn.qkv.bias")):
            return name, ("q", "k", "v"), tensor
        if name.startswith("merger.") and name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            name = "merger.mlp." + name[len("merger."):]
        for which, shard in (("gate_proj", 0), ("up_proj", 1)):
            if f".{which}." in name:
                return name.replace(which, "gate_up_proj"), shard, tensor
        return name, None, tensor
