"""Build tiny random GLM-5.3-Flash checkpoints for tests, demos and benchmarks.

    python -m vllm_glm53.tiny OUT_DIR [--config FILE.json] [--seed N] [--dtype float32|bfloat16]
                                     [--fp8 | --w8a8] [--layout nested|flat]

The weights come from transformers' own ``Glm5NextForConditionalGeneration`` (so transformers loads the very
same files as the numerical reference), plus the MTP layer transformers does not model, a
``generation_config.json`` and a real byte-level BPE tokenizer carrying all 36 GLM-5.3 added tokens.
The default config is small but exercises every code path: KDA and sparse-MLA layers, dense and MoE MLPs,
``full`` and ``shared`` indexer layers, mHC, MTP and the vision tower.

``--fp8`` stores the MLP and expert weights in block FP8 like the released checkpoint; ``--w8a8`` writes what
msmodelslim makes for Ascend A2/A3 instead (int8 MLP and expert weights with per-channel scales, a
``quant_model_description.json``, no ``quantization_config``, and the QuaRot ``rot.safetensors``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from importlib import resources
from pathlib import Path

from vllm_glm53.chat.tokens import (
    ADDED_TOKENS,
    EOS_TOKENS,
    IMAGE_END_TOKEN,
    IMAGE_START_TOKEN,
    IMAGE_TOKEN,
    PAD_TOKEN,
    VIDEO_END_TOKEN,
    VIDEO_START_TOKEN,
    VIDEO_TOKEN,
)

# ---------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------


def build_tokenizer(base_vocab_size: int = 476, corpus: list[str] | None = None, cross_word: bool = False):
    """A byte-level BPE trained on the shipped corpus (or on the lines of ``corpus``), with the 36 added tokens
    appended after it. ``cross_word``: no split into words first, so merges may span words (tokens of at most
    16 characters), which packs a repetitive corpus into far fewer tokens.

    Returns a ``tokenizers.Tokenizer``. Deterministic: the same corpus and size give the same merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not cross_word)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=base_vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
        **({"max_token_length": 16} if cross_word else {}),
    )
    if corpus is None:
        corpus = resources.files("vllm_glm53.data").joinpath("tiny_corpus.txt").read_text(encoding="utf-8").splitlines()
    lines = list(corpus)
    # Repeat so frequent pairs win clearly over ties; merges are then stable across tokenizers versions.
    tok.train_from_iterator(lines * 4, trainer=trainer)
    tok.add_special_tokens(list(ADDED_TOKENS))
    return tok


def write_tokenizer(out_dir: str | os.PathLike, base_vocab_size: int = 476,
                    corpus: list[str] | None = None, cross_word: bool = False) -> dict[str, int]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``; return the special-token ids."""
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(base_vocab_size, corpus, cross_word),
        eos_token=PAD_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    fast.save_pretrained(str(out))
    return {t: fast.convert_tokens_to_ids(t) for t in ADDED_TOKENS}


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------

# Tensors the released checkpoint stores in fp32 whatever the model dtype (architecture.md §12.2).
FP32_SUFFIXES = (
    ".A_log", ".dt_bias", ".q_conv1d.weight", ".k_conv1d.weight", ".v_conv1d.weight",
    ".hc_attn_fn", ".hc_attn_base", ".hc_attn_scale", ".hc_ffn_fn", ".hc_ffn_base", ".hc_ffn_scale",
    ".e_score_correction_bias", ".index_kpool_compress_ape",
)


def default_config() -> dict:
    """The default tiny nested config (text + vision), without token ids (those come from the tokenizer)."""
    return json.loads(resources.files("vllm_glm53.data").joinpath("tiny_config.json").read_text())


def kernel_friendly_overrides() -> dict:
    """Overrides giving the tiny model the real per-head geometry (KDA heads of 128, latent 512, q/k/v heads of
    256, indexer 4 x 128, index_topk 64 in pools of 4) with everything else small: what compiled and GPU kernels
    need to run their real code paths, and what the benchmarks measure."""
    return json.loads(resources.files("vllm_glm53.data").joinpath("kernel_friendly.json").read_text())


def _merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_config(overrides: dict | None, token_ids: dict[str, int]) -> dict:
    """Nested config dict: defaults, then ``overrides`` (text fields, optionally ``vision_config`` and
    top-level keys), then the special-token ids read from the tokenizer."""
    cfg = default_config()
    overrides = dict(overrides or {})
    vision = overrides.pop("vision_config", None)
    top_level = {k: overrides.pop(k) for k in list(overrides) if k in ("architectures", "tie_word_embeddings")}
    text = overrides.pop("text_config", {})
    cfg["text_config"] = _merge(cfg["text_config"], {**text, **overrides})
    if vision:
        cfg["vision_config"] = _merge(cfg["vision_config"], vision)
    cfg.update(top_level)

    text_cfg = cfg["text_config"]
    text_cfg["vocab_size"] = max(int(text_cfg["vocab_size"]), max(token_ids.values()) + 1)
    text_cfg["pad_token_id"] = token_ids[PAD_TOKEN]
    text_cfg["eos_token_id"] = [token_ids[t] for t in EOS_TOKENS]
    cfg.update(
        image_token_id=token_ids[IMAGE_TOKEN],
        video_token_id=token_ids[VIDEO_TOKEN],
        image_start_token_id=token_ids[IMAGE_START_TOKEN],
        image_end_token_id=token_ids[IMAGE_END_TOKEN],
        video_start_token_id=token_ids[VIDEO_START_TOKEN],
        video_end_token_id=token_ids[VIDEO_END_TOKEN],
    )
    # The vision merger's output replaces token embeddings one for one.
    cfg["vision_config"]["out_hidden_size"] = text_cfg["hidden_size"]
    return cfg


# ---------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------


def _perturb(model, generator) -> None:
    """Make parameters that transformers initialises to constants (norm weights of one, zero biases, uniform
    k-pool pooling, zero A_log) random, so that a loader that skips or swaps one of them changes the output."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            if name.endswith(("index_kpool_compress_gate", "index_kpool_compress_ape")):
                p.copy_(0.5 * noise)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * noise)
            elif name.endswith(("A_log", ".base", "dt_bias")) or (name.endswith(".bias") and p.ndim == 1):
                p.add_(0.1 * noise)
            elif name.endswith(".scale") and "_hc." in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1 and name.endswith("weight"):  # RMSNorm / LayerNorm weights
                p.copy_(1.0 + 0.1 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=generator))


def _mtp_tensors(hf_config, generator) -> dict:
    """Checkpoint tensors of the MTP layer (index num_hidden_layers), which transformers does not model.

    The decoder block reuses transformers' own attention and MoE modules so its tensors have exactly the
    released names and shapes; the MoE experts are split into the per-expert checkpoint layout.
    """
    import torch
    from transformers.models.glm5_next import modeling_glm5_next as hf

    text = copy.deepcopy(hf_config.text_config)
    idx = text.num_hidden_layers
    text.layer_types = list(text.layer_types) + ["indexed_attention"]
    text.indexer_types = list(text.indexer_types) + ["full"]
    text.mlp_layer_types = list(text.mlp_layer_types) + ["sparse"]
    d = text.hidden_size

    block = torch.nn.ModuleDict(
        {
            "self_attn": hf.Glm5NextTextAttention(text, layer_idx=idx),
            "mlp": hf.Glm5NextTextMoE(text),
        }
    )
    std = text.initializer_range
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in list(block.named_parameters()) + list(block.named_buffers()):
            if p.ndim >= 2:
                p.copy_(std * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.zeros(p.shape))
        _perturb(block, generator)
        out.update(per_expert_tensors(list(block.named_parameters()) + list(block.named_buffers())))
        for norm in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
            out[f"{norm}.weight"] = 1.0 + 0.1 * torch.randn(d, generator=generator)
        out["eh_proj.weight"] = std * torch.randn(d, 2 * d, generator=generator)
    return out


def per_expert_tensors(named, prefix: str = "") -> dict:
    """Module tensors in the checkpoint's layout: transformers stacks the routed experts (``mlp.experts.gate_up_proj``
    ``[E, 2I, D]``, ``mlp.experts.down_proj`` ``[E, D, I]``); the released checkpoint stores one
    ``mlp.experts.{e}.{gate,up,down}_proj.weight`` per expert. Names get ``prefix``; every tensor is a copy."""
    out = {}
    for name, t in named:
        t = t.detach()
        if name == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[prefix + name] = t.clone()
    return out


def _is_quant_candidate(name: str) -> bool:
    """Linear weights the released FP8 and w8a8 checkpoints store quantized: the language model's dense MLPs,
    shared and routed experts, the MTP layer's included (architecture.md §12.2, ascend.md §5); the vision tower
    stays BF16. The loader never relies on this list: it looks for ``weight_scale_inv`` or the description."""
    return (name.endswith("_proj.weight") and ".mlp." in name and ".mlp.gate." not in name
            and not name.startswith("model.visual."))


def _write_w8a8(out: Path, tensors: dict, quantized: list[str], rotation) -> None:
    """The msmodelslim AscendV1 files (ascend.md §5): weights, their index, the description, the rotation."""
    from safetensors.torch import save_file

    from vllm_glm53.quant import w8a8

    weights_file, rot_file = "quant_model_weights.safetensors", "rot.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / weights_file), metadata={"format": "pt"})
    save_file({w8a8.MTP_ROTATION: rotation.contiguous()}, str(out / rot_file), metadata={"format": "pt"})
    weight_map = {name: weights_file for name in tensors} | {w8a8.MTP_ROTATION: rot_file}
    size = sum(t.numel() * t.element_size() for t in tensors.values()) + rotation.numel() * rotation.element_size()
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / f"{weights_file}.index.json").write_text(json.dumps(index, indent=2) + "\n")
    modules = set(quantized)
    description = {
        "version": "1.0.0", "model_quant_type": w8a8.W8A8_DYNAMIC, "group_size": 0, "metadata": {},
        "optional": {"quarot": {"rotation_map": {"global_rotation": f"optional/{rot_file}"}}},
        "is_rot_used": True,
    }
    for name in sorted(tensors):
        description[name] = w8a8.W8A8_DYNAMIC if name.rpartition(".")[0] in modules else w8a8.FLOAT
    description[w8a8.MTP_ROTATION] = w8a8.FLOAT
    (out / w8a8.DESCRIPTION_FILE).write_text(json.dumps(description, indent=2) + "\n")


def build_checkpoint(
    out_dir: str | os.PathLike,
    overrides: dict | None = None,
    seed: int = 0,
    dtype: str = "float32",
    fp8: bool = False,
    layout: str = "nested",
    w8a8: bool = False,
    tokenizer_corpus: list[str] | None = None,
    base_vocab_size: int = 476,
    cross_word_tokens: bool = False,
) -> Path:
    """Write a tiny checkpoint to ``out_dir`` and return its path (``tokenizer_corpus``, ``base_vocab_size``,
    ``cross_word_tokens``: train the BPE on these lines, to this size, merging across words; see
    :func:`build_tokenizer`)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16, not {dtype!r}")
    if layout not in ("nested", "flat"):
        raise ValueError(f"--layout must be nested or flat, not {layout!r}")
    if fp8 and w8a8:
        raise ValueError("--fp8 and --w8a8 are two different checkpoints; pick one")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    token_ids = write_tokenizer(out, base_vocab_size, tokenizer_corpus, cross_word_tokens)
    cfg_dict = resolve_config(overrides, token_ids)

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    hf_config = Glm5NextConfig(**copy.deepcopy(cfg_dict))
    model = Glm5NextForConditionalGeneration(hf_config).float()
    _perturb(model, generator)
    # save_pretrained writes the released checkpoint naming (per-expert MoE, split conv, layer-level hc_*).
    tmp = out / "_hf"
    model.save_pretrained(str(tmp), safe_serialization=True)
    tensors = {}
    for f in sorted(tmp.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()

    n_layers = hf_config.text_config.num_hidden_layers
    prefix = f"model.language_model.layers.{n_layers}."
    for name, t in _mtp_tensors(hf_config, generator).items():
        tensors[prefix + name] = t

    if layout == "flat":
        tensors = {
            name.replace("model.language_model.", "model.", 1): t
            for name, t in tensors.items()
            if not name.startswith("model.visual.")
        }

    target = torch.float32 if dtype == "float32" else torch.bfloat16
    final: dict[str, torch.Tensor] = {}
    quantized: list[str] = []
    for name, t in tensors.items():
        t = t.float()
        if fp8 and _is_quant_candidate(name):
            from vllm_glm53.quant.fp8_block import quantize_block_fp8

            w8, scale_inv = quantize_block_fp8(t)
            final[name] = w8
            final[name[: -len("weight")] + "weight_scale_inv"] = scale_inv
            quantized.append(name[: -len(".weight")])
            continue
        if w8a8 and _is_quant_candidate(name):
            from vllm_glm53.quant.w8a8 import quantize_weight

            module = name[: -len(".weight")]
            final[name], final[f"{module}.weight_scale"], final[f"{module}.weight_offset"] = quantize_weight(t)
            quantized.append(module)
            continue
        final[name] = t if name.endswith(FP32_SUFFIXES) else t.to(target)
    if w8a8:
        # QuaRot (ascend.md §5) folds the final norm's weight w into lm_head, leaving the norm weightless, and
        # hands the MTP layer rot = Q^T diag(w) Q to restore it. Q = I here (rotate_w8a8_mtp rotates the MTP
        # side): the target's logits are unchanged, the MTP layer gets w * norm(x) after rot as before, and its
        # shared_head.norm is divided by w, so its logits through the folded lm_head and the hidden state it
        # passes to its next draft step (rotated again) are unchanged too.
        text = "model." if layout == "flat" else "model.language_model."
        norm = tensors[text + "norm.weight"].float()
        final[text + "norm.weight"] = torch.ones_like(norm).to(target)
        final["lm_head.weight"] = (tensors["lm_head.weight"].float() * norm).to(target)
        head_norm = f"{text}layers.{n_layers}.shared_head.norm.weight"
        final[head_norm] = (tensors[head_norm].float() / norm).to(target)
        _write_w8a8(out, final, quantized, torch.diag(norm).to(target))
    else:
        save_file({k: v.contiguous() for k, v in final.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})

    config_json = _config_json(cfg_dict, layout, dtype)
    if fp8:
        linear_names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        if layout == "flat":
            linear_names = {n.replace("model.language_model.", "model.", 1) for n in linear_names}
        config_json["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": sorted(n for n in linear_names if n not in set(quantized)),
        }
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    text = cfg_dict["text_config"]
    generation = {"eos_token_id": text["eos_token_id"], "pad_token_id": text["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def _config_json(cfg: dict, layout: str, dtype: str) -> dict:
    if layout == "nested":
        out = copy.deepcopy(cfg)
        out["architectures"] = ["Glm5NextForConditionalGeneration"]
        out["text_config"]["dtype"] = dtype
    else:
        out = {k: v for k, v in cfg["text_config"].items()}
        out["model_type"] = "glm5_next"
        out["architectures"] = ["Glm5NextForCausalLM"]
    out["dtype"] = dtype
    return out


def rotate_w8a8_mtp(path: str | os.PathLike, seed: int) -> None:
    """Rewrite a nested w8a8 checkpoint in place so that its MTP layer works in a basis rotated by a random
    orthogonal ``Q`` (drawn from ``seed``), as QuaRot leaves it, while the target keeps ``Q = I``.

    The MTP layer must then receive ``(w * h) Q`` for the target's weightless-normed hidden state ``h``:
    ``rot.weight`` (applied like ``nn.Linear``, ``h @ rot^T``) becomes ``Q^T diag(w)``, the general form of
    ``Q_target^T diag(w) Q_mtp``; not symmetric, so applying it transposed is an error a test can see. The
    layer's ``hnorm`` weight is folded into ``eh_proj``'s hidden half together with ``Q``
    (``RMSNorm(u Q) = RMSNorm(u) Q``), so the layer computes exactly what the unrotated one computes.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_glm53.quant import w8a8

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if "text_config" not in cfg or not (path / w8a8.DESCRIPTION_FILE).exists():
        raise ValueError("rotate_w8a8_mtp needs a nested w8a8 checkpoint")
    weights_file, rot_file = path / "quant_model_weights.safetensors", path / "rot.safetensors"
    tensors, rot = load_file(str(weights_file)), load_file(str(rot_file))[w8a8.MTP_ROTATION]
    mtp = f"model.language_model.layers.{cfg['text_config']['num_hidden_layers']}."
    d = rot.shape[0]
    q, r = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))  # a uniformly random orthogonal matrix
    hnorm, eh = tensors[mtp + "hnorm.weight"], tensors[mtp + "eh_proj.weight"]
    eh_h = eh[:, d:].double() * hnorm.double() @ q
    tensors[mtp + "eh_proj.weight"] = torch.cat([eh[:, :d], eh_h.to(eh.dtype)], dim=1)
    tensors[mtp + "hnorm.weight"] = torch.ones_like(hnorm)
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    save_file({w8a8.MTP_ROTATION: (q.t() @ rot.double()).to(rot.dtype).contiguous()}, str(rot_file),
              metadata={"format": "pt"})


def make_exact_mtp(path: str | os.PathLike, keep: float = 0.0) -> None:
    """Rewrite a nested float checkpoint in place so that its MTP layer drafts exactly what the main model will
    generate (for speculative-decoding tests and benchmarks).

    Every attention and MLP output projection is zeroed, so the main model's prediction depends on the current
    token only (its hidden state is ``norm(embed(token))``); the MTP layer is made to compute that same
    function of the token it is given (``eh_proj`` passes the normed embedding through, the block adds
    nothing, ``shared_head.norm`` is the final norm).

    With ``keep > 0`` the output projections are scaled by ``keep`` instead of zeroed: the main model still reads
    its context (its KDA states and attention matter), a little, so the drafts are often right but not always
    (any number of drafts accepted, as in real serving).
    """
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if "text_config" not in cfg or "quantization_config" in cfg:
        raise ValueError("make_exact_mtp needs a nested, unquantized checkpoint")
    tensors = load_file(str(path / "model.safetensors"))
    mtp = f"model.language_model.layers.{cfg['text_config']['num_hidden_layers']}."
    for name, t in tensors.items():
        if name.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
            tensors[name] = t * keep
    eh = tensors[mtp + "eh_proj.weight"]
    d = eh.shape[0]
    passthrough = torch.zeros(d, 2 * d)
    passthrough[:, :d] = torch.eye(d)
    tensors[mtp + "eh_proj.weight"] = passthrough.to(eh.dtype)
    tensors[mtp + "enorm.weight"] = torch.ones_like(tensors[mtp + "enorm.weight"])
    tensors[mtp + "shared_head.norm.weight"] = tensors["model.language_model.norm.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_glm53.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--config", help="JSON file of overrides for the text config (and vision_config)")
    parser.add_argument("--kernel-friendly", action="store_true",
                        help="real per-head geometry (latent 512, heads of 128/256), applied before --config")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    quant = parser.add_mutually_exclusive_group()
    quant.add_argument("--fp8", action="store_true", help="store MLP weights as block-FP8 like the release")
    quant.add_argument("--w8a8", action="store_true",
                       help="store MLP weights as msmodelslim W8A8_DYNAMIC (the Ascend A2/A3 checkpoint)")
    parser.add_argument("--layout", choices=["nested", "flat"], default="nested")
    parser.add_argument("--exact-mtp", action="store_true",
                        help="zero the main model's sublayers and make the MTP layer draft exactly (spec-decode tests)")
    args = parser.parse_args(argv)
    overrides = kernel_friendly_overrides() if args.kernel_friendly else {}
    if args.config:
        overrides = _merge(overrides, json.loads(Path(args.config).read_text()))
    path = build_checkpoint(args.out_dir, overrides or None, args.seed, args.dtype, args.fp8, args.layout, args.w8a8)
    if args.exact_mtp:
        make_exact_mtp(path)
    print(f"wrote tiny GLM-5.3 checkpoint to {path}")


if __name__ == "__main__":
    main()
