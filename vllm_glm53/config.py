"""The GLM-5.3 text config as the plugin reads it: nested or flat, normalised, defaulted and validated.

transformers' ``Glm5NextTextConfig`` already unpacks ``linear_attn_config`` and derives schedules, but a
checkpoint's config can reach us through other routes (flat configs, vLLM's own rewrites for the MTP draft),
and several keys vLLM 0.32 reads are unknown to transformers. ``TextArch`` is the single normalised view every
layer is built from; invalid values fail here with one message naming the key, not deep inside a layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A checkpoint config value the plugin cannot serve."""


def text_config(hf_config: Any) -> Any:
    """The text part of a nested (``text_config``) or flat config."""
    return getattr(hf_config, "text_config", None) or hf_config


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = getattr(cfg, key, None)
    return default if value is None else value


def _linear_attn(cfg: Any, key: str, nested: str, default: Any) -> Any:
    """Read a KDA field from the flat name or, failing that, from ``linear_attn_config``."""
    value = getattr(cfg, key, None)
    if value is None:
        value = (getattr(cfg, "linear_attn_config", None) or {}).get(nested)
    return default if value is None else value


def _layer_types(cfg: Any, n: int) -> list[str]:
    raw = getattr(cfg, "layer_types", None)
    if raw is None:
        return ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    # Released configs say "deepseek_sparse_attention"; transformers normalises some spellings. Anything that
    # is not KDA is sparse MLA.
    return ["linear_attention" if t in ("linear_attention", "mamba") else "indexed_attention" for t in raw]


def _indexer_types(cfg: Any, n: int) -> list[str]:
    raw = getattr(cfg, "indexer_types", None)
    if raw is not None:
        return list(raw)
    pattern = getattr(cfg, "index_topk_pattern", None)
    if pattern is not None:
        return ["shared" if str(c).upper() == "S" else "full" for c in pattern]
    freq = max(int(_get(cfg, "index_topk_freq", 1)), 1)
    offset = int(_get(cfg, "index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


# The sparse-MLA cache's smallest page, in tokens (LatentCacheBackend accepts block sizes that are multiples of it)
# and how many pools of raw indexer inputs such a page keeps (backends/latent_cache.py): the per-token share of that
# region in cache_row_size is sized for them, and a larger page keeps proportionally more.
MIN_CACHE_BLOCK = 128
RAW_POOLS_PER_PAGE = 2


def cache_row_size(latent_dim: int, index_dim: int, kp: int, block_size: int = MIN_CACHE_BLOCK,
                   raw_pools: int = RAW_POOLS_PER_PAGE) -> int:
    """Values per token in a sparse-MLA layer's cache page (vllm_glm53/backends/latent_cache.py): the latent, a
    kp-th of a pooled indexer key, and a ``block_size``-th of the page's region for the raw key and pooling-gate
    logits of ``raw_pools`` incomplete pools (kp - 1 tokens each)."""
    raw = raw_pools * (kp - 1) * 2 * index_dim
    return latent_dim + -(-index_dim // kp) + -(-raw // block_size)


@dataclass(frozen=True)
class TextArch:
    """Everything the text model needs, with real names (architecture.md §1.3)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    rms_norm_eps: float
    # dense MLP / MoE
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    # sparse MLA
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    # indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None
    # mHC
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    # MTP
    num_mtp_layers: int

    def is_kda(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"

    def is_moe(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_kda(i)]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_kda(i)]

    @property
    def cache_row_size(self) -> int:
        """Values per token in a sparse-MLA layer's cache page (:func:`cache_row_size`)."""
        return cache_row_size(self.kv_lora_rank, self.index_head_dim, self.index_kpool)

    def selection_in_flight(self, boundary: int) -> bool:
        """Whether the sparse selection of a ``full`` layer before ``boundary`` is still needed by a ``shared``
        layer at or after it: the first MLA layer from ``boundary`` on is a ``shared`` one. A pipeline stage that
        starts at ``boundary`` then receives the selection with the residual streams."""
        first_mla = next((i for i in range(boundary, self.num_layers) if not self.is_kda(i)), None)
        return first_mla is not None and self.indexer_types[first_mla] == "shared"

    @property
    def index_select_width(self) -> int:
        """Width of one query's selected-token row: top-k tokens of whole pools plus the incomplete tail."""
        return self.index_topk + self.index_kpool - 1


def text_arch(hf_config: Any) -> TextArch:
    """Normalise and validate the text config of a nested or flat ``glm5_next`` config."""
    cfg = text_config(hf_config)
    n = int(cfg.num_hidden_layers)
    layer_types = _layer_types(cfg, n)
    mlp_types = getattr(cfg, "mlp_layer_types", None)
    if mlp_types is None:
        # transformers ignores first_k_dense_replace and makes the first min(3, n) layers dense.
        mlp_types = ["dense" if i < min(3, n) else "sparse" for i in range(n)]
    indexer_types = _indexer_types(cfg, n)
    lower_bound = _linear_attn(cfg, "linear_lower_bound", "gate_lower_bound", None)
    if lower_bound is None and (getattr(cfg, "linear_attn_config", None) or {}).get("safe_gate", True):
        lower_bound = -5.0

    arch = TextArch(
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        num_layers=n,
        layer_types=tuple(layer_types),
        mlp_layer_types=tuple(mlp_types),
        indexer_types=tuple(indexer_types),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-5)),
        intermediate_size=int(cfg.intermediate_size),
        moe_intermediate_size=int(cfg.moe_intermediate_size),
        n_routed_experts=int(_get(cfg, "n_routed_experts", _get(cfg, "num_local_experts", 0))),
        num_experts_per_tok=int(cfg.num_experts_per_tok),
        n_shared_experts=int(_get(cfg, "n_shared_experts", 0)),
        n_group=int(_get(cfg, "n_group", 1)),
        topk_group=int(_get(cfg, "topk_group", 1)),
        norm_topk_prob=bool(_get(cfg, "norm_topk_prob", True)),
        routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", 1.0)),
        swiglu_limit=float(_get(cfg, "swiglu_limit", 10.0)),
        num_heads=int(cfg.num_attention_heads),
        q_lora_rank=int(_get(cfg, "q_lora_rank", 0)),
        kv_lora_rank=int(cfg.kv_lora_rank),
        qk_nope_head_dim=int(cfg.qk_nope_head_dim),
        v_head_dim=int(cfg.v_head_dim),
        index_n_heads=int(cfg.index_n_heads),
        index_head_dim=int(cfg.index_head_dim),
        index_topk=int(cfg.index_topk),
        index_kpool=int(_get(cfg, "index_kpool", 16)),
        linear_num_heads=int(_linear_attn(cfg, "linear_num_heads", "num_heads", 64)),
        linear_head_dim=int(_linear_attn(cfg, "linear_head_dim", "head_dim", 128)),
        conv_kernel=int(_linear_attn(cfg, "linear_conv_kernel_dim", "short_conv_kernel_size", 4)),
        gate_lower_bound=None if lower_bound is None else float(lower_bound),
        hc_mult=int(_get(cfg, "hc_mult", 4)),
        hc_eps=float(_get(cfg, "hc_eps", 1e-6)),
        hc_sinkhorn_iters=int(_get(cfg, "hc_sinkhorn_iters", 20)),
        num_mtp_layers=int(_get(cfg, "num_nextn_predict_layers", 0)),
    )
    _validate(arch, cfg)
    return arch


def _validate(a: TextArch, cfg: Any) -> None:
    problems = []
    for key, values in (("layer_types", a.layer_types), ("mlp_layer_types", a.mlp_layer_types),
                        ("indexer_types", a.indexer_types)):
        if len(values) < a.num_layers:
            problems.append(f"{key} has {len(values)} entries for num_hidden_layers={a.num_layers}")
    bad_mlp = sorted(set(a.mlp_layer_types) - {"dense", "sparse"})
    if bad_mlp:
        problems.append(f"mlp_layer_types may only contain 'dense' and 'sparse', got {bad_mlp}")
    bad_idx = sorted(set(a.indexer_types) - {"full", "shared"})
    if bad_idx:
        problems.append(f"indexer_types may only contain 'full' and 'shared', got {bad_idx}")
    if int(_get(cfg, "qk_rope_head_dim", 0)) != 0:
        problems.append("qk_rope_head_dim must be 0 (GLM-5.3 sparse MLA uses no rotary embedding)")
    if int(_get(cfg, "num_key_value_heads", a.num_heads)) != a.num_heads:
        problems.append("num_key_value_heads must equal num_attention_heads")
    if a.q_lora_rank <= 0:
        problems.append("q_lora_rank must be set (> 0)")
    if a.index_kpool <= 0 or a.index_topk % a.index_kpool != 0:
        problems.append(
            f"index_topk ({a.index_topk}) must be a positive multiple of index_kpool ({a.index_kpool})"
        )
    if getattr(cfg, "index_kpool_always_select_tail", True) is False:
        problems.append("index_kpool_always_select_tail=False is not supported")
    if getattr(cfg, "mhc", True) is False:
        problems.append("mhc=False (plain residual variant) is not supported")
    if a.n_routed_experts and a.num_experts_per_tok > a.n_routed_experts:
        problems.append("num_experts_per_tok exceeds n_routed_experts")
    if a.n_group <= 0 or a.n_routed_experts % a.n_group != 0 or a.topk_group > a.n_group:
        problems.append("n_group must divide n_routed_experts and topk_group must not exceed n_group")
    if _get(cfg, "scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func {cfg.scoring_func!r} is not supported (only 'sigmoid')")
    if not a.kda_layers and not a.mla_layers:
        problems.append("the model has no layers")
    # The first MLA layer cannot share a selection: nothing came before it.
    first_mla = next((i for i in range(a.num_layers) if not a.is_kda(i)), None)
    if first_mla is not None and a.indexer_types[first_mla] == "shared":
        problems.append(f"layer {first_mla} is the first sparse-MLA layer and cannot have a 'shared' indexer")
    if problems:
        raise ConfigError("unsupported glm5_next config: " + "; ".join(problems))
