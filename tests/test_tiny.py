"""The tiny checkpoint builder: transformers loads what it writes, the tokenizer is real, FP8 is faithful."""

import json

import pytest
import torch
from safetensors.torch import load_file

from vllm_glm53.chat.tokens import ADDED_TOKENS, EOS_TOKENS, IMAGE_TOKEN, PAD_TOKEN
from vllm_glm53.tiny import main as tiny_main


@pytest.fixture(scope="module")
def default_ckpt(tiny_ckpt):
    return tiny_ckpt("default")


def test_transformers_loads_every_weight(default_ckpt):
    from transformers import Glm5NextForConditionalGeneration

    _, info = Glm5NextForConditionalGeneration.from_pretrained(str(default_ckpt), output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["mismatched_keys"]
    # transformers does not model the MTP layer (index num_hidden_layers = 5): only those tensors are extra.
    assert info["unexpected_keys"] and all(".layers.5." in k for k in info["unexpected_keys"])


def test_checkpoint_covers_every_code_path(default_ckpt):
    cfg = json.loads((default_ckpt / "config.json").read_text())
    text = cfg["text_config"]
    names = load_file(str(default_ckpt / "model.safetensors")).keys()
    assert {"linear_attention", "deepseek_sparse_attention"} <= set(text["layer_types"])
    assert {"dense", "sparse"} <= set(text["mlp_layer_types"])
    assert {"full", "shared"} <= set(text["indexer_types"])
    assert any(n.startswith("model.visual.") for n in names)
    assert any(".layers.5.eh_proj" in n for n in names)  # the MTP layer
    shared = text["indexer_types"].index("shared")
    assert not any(f"layers.{shared}.self_attn.indexer" in n for n in names)


def test_indexer_pooling_parameters_are_not_trivial(default_ckpt):
    tensors = load_file(str(default_ckpt / "model.safetensors"))
    gate = tensors["model.language_model.layers.3.self_attn.indexer.index_kpool_compress_gate"]
    ape = tensors["model.language_model.layers.3.self_attn.indexer.index_kpool_compress_ape"]
    assert gate.std() > 0.1 and not torch.allclose(gate, torch.ones_like(gate))
    assert ape.abs().max() > 0.1 and ape.dtype == torch.float32


def test_tokenizer_round_trips_and_keeps_added_tokens_whole(default_ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_ckpt))
    text = "Hello, wörld! 今天天气很好。 {\"a\": [1, 2.5]}\n\tdef f(): return 42"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ids = [tok.convert_tokens_to_ids(t) for t in ADDED_TOKENS]
    assert len(set(ids)) == 36
    for token, i in zip(ADDED_TOKENS, ids):
        assert tok.encode(token, add_special_tokens=False) == [i]
    cfg = json.loads((default_ckpt / "config.json").read_text())
    assert cfg["text_config"]["pad_token_id"] == tok.convert_tokens_to_ids(PAD_TOKEN)
    assert cfg["text_config"]["eos_token_id"] == [tok.convert_tokens_to_ids(t) for t in EOS_TOKENS]
    assert cfg["image_token_id"] == tok.convert_tokens_to_ids(IMAGE_TOKEN)
    gen = json.loads((default_ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["text_config"]["eos_token_id"]


def test_fp8_checkpoint_dequantizes_to_the_float_weights(tmp_path):
    tiny_main([str(tmp_path / "f32"), "--seed", "3"])
    tiny_main([str(tmp_path / "fp8"), "--seed", "3", "--fp8"])
    ref = load_file(str(tmp_path / "f32" / "model.safetensors"))
    q = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    scaled = [n for n in q if n.endswith("weight_scale_inv")]
    assert scaled, "no FP8 tensors written"
    for name in scaled:
        w = name[: -len("_scale_inv")]
        assert q[w].dtype == torch.float8_e4m3fn
        s = q[name]
        n, k = q[w].shape
        assert s.shape == ((n + 127) // 128, (k + 127) // 128)
        deq = q[w].float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        err = (deq - ref[w]).abs().max() / ref[w].abs().max()
        assert err <= 2 ** -3, f"{w}: relative error {err}"  # e4m3 has 3 mantissa bits
    # Everything else is stored as before.
    for name, t in ref.items():
        if name + "_scale_inv" not in q:
            assert torch.equal(q[name], t), name


def test_flat_layout_is_text_only(tiny_ckpt):
    flat = tiny_ckpt("flat-t", layout="flat", seed=1)
    cfg = json.loads((flat / "config.json").read_text())
    assert cfg["architectures"] == ["Glm5NextForCausalLM"] and "text_config" not in cfg
    names = load_file(str(flat / "model.safetensors")).keys()
    assert all(n.startswith(("model.layers.", "model.embed_tokens", "model.norm", "lm_head")) for n in names)
