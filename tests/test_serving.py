"""Who serves GLM-5.3 (issue #15): vLLM's own model on CUDA/ROCm, the plugin's on CPU and where vLLM's cannot run,
``VLLM_GLM53_MODEL`` to force a side; what ``register()`` leaves to vLLM in each case."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_glm53 import envs, serving

ARCHS = ["Glm5NextForCausalLM", "Glm5NextForConditionalGeneration", "Glm5NextMTPModel"]


@pytest.mark.parametrize("platform, choice, ascend, expected", [
    ("cuda", "auto", None, serving.VLLM),
    ("rocm", "auto", None, serving.VLLM),
    ("cpu", "auto", None, serving.PLUGIN),
    ("xpu", "auto", None, serving.PLUGIN),  # vLLM's glm5next raises on XPU at import
    ("tpu", "auto", None, serving.PLUGIN),
    ("npu", "auto", None, serving.PLUGIN),
    ("npu", "auto", "vllm_ascend.models.glm5_next", serving.VLLM_ASCEND),
    ("cuda", "plugin", None, serving.PLUGIN),
    ("rocm", "plugin", None, serving.PLUGIN),
    ("cpu", "plugin", None, serving.PLUGIN),
    ("npu", "plugin", "vllm_ascend.models.glm5_next", serving.PLUGIN),
    ("cuda", "vllm", None, serving.VLLM),
    ("npu", "vllm", "vllm_ascend.models.glm5_next", serving.VLLM_ASCEND),
])
def test_who_serves(platform, choice, ascend, expected):
    served = serving.decide(platform, choice, ascend)
    assert served.model == expected
    assert served.reason  # the log line says why
    if choice != "auto":
        assert "VLLM_GLM53_MODEL" in served.reason


@pytest.mark.parametrize("platform", ["cpu", "xpu", "npu"])
def test_forcing_vllms_model_where_it_cannot_run_says_so(platform):
    with pytest.raises(serving.ServingError, match=r"VLLM_GLM53_MODEL=vllm.*cannot run"):
        serving.decide(platform, "vllm", None)


def test_an_unknown_choice_names_the_variable_and_the_valid_values(monkeypatch):
    monkeypatch.setenv("VLLM_GLM53_MODEL", "mine")
    with pytest.raises(envs.EnvError, match=r"VLLM_GLM53_MODEL='mine'.*auto, plugin, vllm"):
        envs.VLLM_GLM53_MODEL
    monkeypatch.setenv("VLLM_GLM53_MODEL", " Plugin ")
    assert envs.VLLM_GLM53_MODEL == "plugin"


# In a fresh process, for each scenario in turn: replace vLLM's platform by one that says it is CUDA or ROCm (a
# CPU platform object with another enum: nothing here needs a GPU) or keep the real one, set VLLM_GLM53_MODEL, run
# register() afresh, and report what each vLLM registry holds. Scenarios share the process (vLLM starts in
# seconds, not tens of them): the GPU ones come first, so a model registered by a later one cannot hide a leak.
_PROBE = r"""
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, format="%%(message)s", stream=sys.stdout)
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import PlatformEnum
from vllm import ModelRegistry
from vllm.tokenizers.registry import TokenizerRegistry
from vllm.renderers.registry import RENDERER_REGISTRY
from vllm.tool_parsers import ToolParserManager
from vllm.reasoning import ReasoningParserManager
from vllm.transformers_utils.model_arch_config_convertor import MODEL_ARCH_CONFIG_CONVERTORS as conv
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
import vllm_glm53

for scenario in sys.argv[1:]:
    fake, choice = scenario.split(":")
    if fake != "none":
        class FakeGpu(CpuPlatform):
            _enum = PlatformEnum.CUDA if fake == "cuda" else PlatformEnum.ROCM
            device_name = device_type = fake
        platforms._current_platform = FakeGpu()
    os.environ["VLLM_GLM53_MODEL"] = choice
    vllm_glm53._registered = None
    registered = vllm_glm53.register()
    state = {
        "scenario": scenario,
        "models": {a: ModelRegistry.models[a].module_name for a in %(archs)r},
        "tokenizer": TokenizerRegistry.tokenizers.get("glm5_next"),
        "renderer": RENDERER_REGISTRY.renderers.get("glm5_next"),
        "tool": {n: ToolParserManager.lazy_parsers.get(n, [None])[0] for n in ("glm47", "glm45")},
        "reasoning": {n: ReasoningParserManager.lazy_parsers.get(n, [None])[0] for n in ("glm47", "glm45")},
        "convertor": getattr(conv.get("glm5_next"), "__module__", None),
        "quant": sorted(m for m in QUANTIZATION_METHODS if m.startswith("glm5_next") or m == "ascend"),
        "registered": registered,
        "vllm_model_imported": any(m.startswith("vllm.models.glm5next") for m in sys.modules),
    }
    print("STATE" + json.dumps(state), flush=True)
""" % {"archs": ARCHS}


def _probe(*scenarios: str) -> dict[str, tuple[dict, list[str]]]:
    """``{scenario: (registry state, this scenario's log lines)}`` for scenarios ``PLATFORM:VLLM_GLM53_MODEL``."""
    out = subprocess.run([sys.executable, "-c", _PROBE, *scenarios], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_GLM53_DISABLE": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    found, lines = {}, []
    for line in out.stdout.splitlines():
        if line.startswith("STATE"):
            state = json.loads(line[len("STATE"):])
            found[state["scenario"]] = (state, lines)
            lines = []
        else:
            lines.append(line)
    assert list(found) == list(scenarios), out.stdout[-3000:]
    return found


@pytest.fixture(scope="module")
def probed():
    return _probe("cuda:auto", "rocm:auto", "cuda:plugin")


@pytest.fixture(scope="module")
def on_cpu():
    return _probe("none:auto")["none:auto"]


def _served_line(log: list[str]) -> str:
    served = [line for line in log if "GLM-5.3 is served by" in line]
    assert len(served) == 1, log  # one start-up line says which model serves and why
    return served[0]


@pytest.mark.parametrize("fake", ["cuda", "rocm"])
def test_on_gpus_vllms_own_model_serves_and_the_plugin_completes_it(fake, probed, on_cpu):
    state, log = probed[f"{fake}:auto"]
    # The model classes and vLLM's own sizing hook stay vLLM's, untouched ...
    assert state["models"] == {a: "vllm.models.glm5next" for a in ARCHS}
    assert not (state["convertor"] or "").startswith("vllm_glm53")  # vLLM's own (0.32: none for glm5_next)
    assert not state["vllm_model_imported"]  # decided without importing vLLM's model (torchvision, CUDA ops)
    assert state["quant"] == []  # vLLM's Fp8Config takes the FP8 checkpoint
    assert not any(item.startswith("model ") for item in state["registered"])
    # ... while everything the front-end needs is the plugin's, as on CPU
    assert state["tokenizer"] == on_cpu[0]["tokenizer"] == ["vllm_glm53.chat.tokenizer", "Glm5NextTokenizer"]
    assert state["renderer"] == on_cpu[0]["renderer"] and state["renderer"][0].startswith("vllm_glm53.")
    assert state["tool"] == {"glm47": "vllm_glm53.parsers.tool", "glm45": "vllm_glm53.parsers.tool"}
    assert state["reasoning"] == {"glm47": "vllm_glm53.parsers.reasoning", "glm45": "vllm_glm53.parsers.reasoning"}
    assert "vLLM's own GLM5Next" in _served_line(log) and f"runs on {fake}" in _served_line(log)


def test_forcing_the_plugins_model_on_a_gpu(probed):
    state, log = probed["cuda:plugin"]
    assert state["models"] == {a: "vllm_glm53.model" for a in ARCHS}
    assert state["convertor"] == "vllm_glm53._vllm"
    assert "glm5_next_fp8" in state["quant"]
    assert "VLLM_GLM53_MODEL=plugin" in _served_line(log)


def test_on_cpu_the_plugins_model_serves(on_cpu):
    state, log = on_cpu
    assert state["models"] == {a: "vllm_glm53.model" for a in ARCHS}
    assert state["convertor"] == "vllm_glm53._vllm"
    assert state["quant"] == ["ascend", "glm5_next_fp8"]
    assert [f"model {a}" for a in ARCHS] == [i for i in state["registered"] if i.startswith("model ")]
    assert "the plugin's model" in _served_line(log) and "cannot run on cpu" in _served_line(log)


@pytest.mark.parametrize("value, error, message", [
    ("vllm", serving.ServingError, "VLLM_GLM53_MODEL=vllm, but vLLM's own GLM5Next cannot run on cpu"),
    ("both", envs.EnvError, "VLLM_GLM53_MODEL='both' is not valid; expected one of: auto, plugin, vllm"),
])
def test_bad_choices_stop_register_with_a_clear_message(value, error, message, monkeypatch):
    import vllm_glm53

    monkeypatch.setenv("VLLM_GLM53_MODEL", value)
    monkeypatch.setattr(vllm_glm53, "_registered", None)
    with pytest.raises(error) as raised:
        vllm_glm53.register()
    assert message in str(raised.value)


# ---------------------------------------------------------------------------------------------------------------
# What each model can serve: the declared capabilities are the model classes' own, and the plugin's model refuses at
# start-up exactly what the recipe builder refuses (both call serving.refusals).
# ---------------------------------------------------------------------------------------------------------------


def test_declared_interfaces_are_the_plugins_classes():
    from tests.vllm_glm5next import interfaces
    from vllm_glm53 import model

    assert interfaces(model.Glm5NextForConditionalGeneration) == sorted(serving.PLUGIN_MODEL.interfaces)
    # the text-only class differs by the multimodal interface alone
    assert interfaces(model.Glm5NextForCausalLM) == sorted(serving.PLUGIN_MODEL.interfaces - {"SupportsMultiModal"})


def test_declared_interfaces_are_vllms_own_classes():
    from tests.vllm_glm5next import vllm_interfaces

    found = vllm_interfaces()
    # the released checkpoint is Glm5NextForConditionalGeneration
    assert found["Glm5NextForConditionalGeneration"] == sorted(serving.VLLM_MODEL.interfaces)


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory):
    """``VllmConfig``s as vLLM's own argument handling builds them for a tiny checkpoint (no engine starts)."""
    from vllm.engine.arg_utils import EngineArgs

    import vllm_glm53
    from vllm_glm53.tiny import build_checkpoint

    vllm_glm53.register()
    ckpt = build_checkpoint(tmp_path_factory.mktemp("serving") / "tiny")

    def make(**options):
        return EngineArgs(model=str(ckpt), max_model_len=512, enforce_eager=True, **options).create_engine_config()

    return make


@pytest.mark.parametrize("options, flag", [
    (dict(kv_cache_dtype="fp8"), "--kv-cache-dtype fp8"),
    (dict(enable_lora=True), "--enable-lora"),
    (dict(attention_backend="FLASH_ATTN"), "--attention-backend FLASH_ATTN"),
    (dict(sparse_indexer_topk_backend="aiter"), "--sparse-indexer-topk-backend aiter"),
])
def test_the_plugins_model_refuses_at_start_up_what_it_would_ignore(engine_config, options, flag):
    from vllm.config import set_current_vllm_config

    from vllm_glm53.model import Glm5NextForConditionalGeneration
    from vllm_glm53.recipes import serve_options

    config = engine_config(**options)
    with set_current_vllm_config(config), pytest.raises(ValueError, match="cannot serve this configuration") as err:
        Glm5NextForConditionalGeneration(vllm_config=config)
    assert flag in str(err.value)
    # the recipe builder reads the same option from a command line and refuses it with the same words
    argv = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    from_command_line = serving.refusals(serving.PLUGIN_MODEL, serve_options(argv, "bf16"))
    assert len(from_command_line) == 1 and from_command_line[0] in str(err.value)


def test_pipeline_and_expert_parallel_are_served_with_speculation_one_step_at_a_time(engine_config):
    """vLLM accepts PP for the plugin's model by its interface (SupportsPP) and the model accepts PP, EP and PP with
    MTP drafts; for the last, the config hook (adapter ledger 10) keeps one step in flight, since vLLM 0.32's V1
    runner cannot pipeline drafts; a PP config without drafts keeps vLLM's PP-deep batch queue. The builder agrees."""
    from vllm_glm53.model.model import check_serve_options
    from vllm_glm53.recipes import serve_options

    pp = engine_config(pipeline_parallel_size=2, enable_prefix_caching=False)  # tiny split 3|2: stage 1 has no KDA
    check_serve_options(pp)
    check_serve_options(engine_config(tensor_parallel_size=2, enable_expert_parallel=True))
    drafts = engine_config(pipeline_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                           enable_prefix_caching=False)
    check_serve_options(drafts)
    assert (pp.max_concurrent_batches, drafts.max_concurrent_batches) == (2, 1)
    argv = ["--pipeline-parallel-size", "2", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']
    assert serving.refusals(serving.PLUGIN_MODEL, serve_options(argv, "bf16", "cpu")) == []
    # elsewhere the plugin's model would run on a runner it has not been made to work with: refused, naming both flags
    (refused,) = serving.refusals(serving.PLUGIN_MODEL, serve_options(argv, "bf16", "cuda"))
    assert "--speculative-config method mtp with --pipeline-parallel-size 2" in refused
    assert serving.refusals(serving.VLLM_MODEL, serve_options(argv, "bf16", "cuda")) == []
    ngram = ["--pipeline-parallel-size", "2", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    (refused,) = serving.refusals(serving.PLUGIN_MODEL, serve_options(ngram, "bf16", "cpu"))
    assert "--speculative-config method ngram with --pipeline-parallel-size 2" in refused


def test_default_options_are_served(engine_config):
    """vLLM's defaults give a config the plugin's model accepts, with what vLLM gives any hybrid model on CPU:
    chunked prefill and prefix caching, the KDA state kept at block edges ("align" mode), block 128. (vLLM's CPU
    policy for its own MLA kernels, block 16 and one-step prefill, does not apply to the plugin's backend.)"""
    from vllm_glm53.model.model import check_serve_options

    config = engine_config()
    assert config.cache_config.enable_prefix_caching and config.scheduler_config.enable_chunked_prefill
    assert config.cache_config.mamba_cache_mode == "align"
    assert config.cache_config.block_size == 128 and not config.model_config.use_mla
    check_serve_options(config)  # raises if anything were refused


def test_prefix_caching_with_mtp_is_served(engine_config):
    """Prefix caching (vLLM's default, align mode) with MTP drafts: the plugin's model accepts it, and tells vLLM
    that its KDA states are copied whole from the draft slot of the last accepted token (both states, conv window
    included: vLLM's whole-slot copy spec, the only other one its fused copy kernels take being the shifted conv
    window); the recipe builder keeps prefix caching on with the mtp feature."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec

    from vllm_glm53.model.model import Glm5NextForCausalLM, check_serve_options
    from vllm_glm53.recipes import build

    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    config = engine_config(speculative_config=mtp)  # prefix caching on: vLLM's default
    assert config.cache_config.enable_prefix_caching and config.cache_config.mamba_cache_mode == "align"
    check_serve_options(config)
    assert Glm5NextForCausalLM.get_mamba_state_copy_func() == (get_temporal_copy_spec, get_temporal_copy_spec)
    opts = serving.ServeOptions(speculative_method="mtp", prefix_caching=True)
    assert not serving.refusals(serving.PLUGIN_MODEL, opts)
    plan = build("cpu", features=["mtp"])
    assert all("--no-enable-prefix-caching" not in launch.args for launch in plan.serve_launches())


def test_prefix_caching_with_a_pipeline_stage_without_kda_is_refused_at_start_up_naming_the_flags(engine_config,
                                                                                                   monkeypatch):
    """vLLM keeps prefix-cache state snapshots ("align" mode) only on stages with hybrid-state layers (its worker
    asserts on a stage without): a split whose stage holds sparse-MLA layers only is refused before vLLM sizes
    caches, naming the stage, the partition variable and the flag; a split with KDA layers on every stage serves
    with prefix caching (tests/test_parallel.py runs one)."""
    # the tiny checkpoint: layers 0-2 KDA, 3-4 sparse MLA; vLLM's default split of 5 layers is 0-2 | 3-4
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2") as err:
        engine_config(pipeline_parallel_size=2)  # prefix caching on: vLLM's default
    for words in ("stage 1 (layers 3-4)", "VLLM_PP_LAYER_PARTITION", "--no-enable-prefix-caching"):
        assert words in str(err.value)
    assert engine_config(pipeline_parallel_size=2, enable_prefix_caching=False).cache_config.mamba_cache_mode == "none"
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,3")
    assert engine_config(pipeline_parallel_size=2).cache_config.mamba_cache_mode == "align"


# ---------------------------------------------------------------------------------------------------------------
# The multimodal hand-off: where vLLM's own model serves, the plugin's renderer feeds vLLM's own processor.
# ---------------------------------------------------------------------------------------------------------------

# What the released checkpoint ships beside its weights, and vLLM's processor (transformers' Glm5NextProcessor)
# needs; the plugin's processor reads the same files.
HF_PROCESSOR_FILES = {
    "processor_config.json": {"processor_class": "Glm5NextProcessor"},
    "preprocessor_config.json": {"image_processor_type": "Glm5NextImageProcessor"},
    "video_preprocessor_config.json": {"video_processor_type": "Glm5NextVideoProcessor"},
}


IMAGE_SIZES = [(300, 400), (64, 900)]


@pytest.fixture(scope="module")
def handoff(tmp_path_factory):
    """A tiny checkpoint with the released processor files, a chat with one image rendered by the plugin, an image
    of each of IMAGE_SIZES, and what vLLM's own GLM5Next processor makes of each (one child process for all: it
    needs a torchvision stand-in): ``(checkpoint, prompt, {size: (pixels, vLLM's summary)})``."""
    import shutil

    import numpy as np
    from transformers import AutoTokenizer

    from vllm_glm53.chat import render
    from vllm_glm53.tiny import build_checkpoint

    root = tmp_path_factory.mktemp("handoff")
    ckpt = root / "ckpt"
    shutil.copytree(build_checkpoint(root / "built"), ckpt)
    for name, content in HF_PROCESSOR_FILES.items():
        (ckpt / name).write_text(json.dumps(content))
    text = render([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}])
    prompt = AutoTokenizer.from_pretrained(str(ckpt)).encode(text, add_special_tokens=False)
    images, paths = {}, []
    for i, size in enumerate(IMAGE_SIZES):
        images[size] = np.random.default_rng(7 + i).integers(0, 256, (*size, 3), dtype=np.uint8)
        paths.append(str(root / f"image{i}.npy"))
        np.save(paths[-1], images[size])
    (root / "spec.json").write_text(json.dumps({"prompt": prompt, "images": paths, "max_model_len": 4096}))

    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "vllm_glm5next.py"), "process",
                          str(ckpt), str(root / "spec.json")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    theirs = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("PROCESSED"))[len("PROCESSED"):])
    return ckpt, prompt, {size: (images[size], summary) for size, summary in zip(IMAGE_SIZES, theirs, strict=True)}


@pytest.mark.parametrize("size", IMAGE_SIZES)
def test_the_plugins_renderer_feeds_vllms_own_multimodal_processor(size, handoff):
    """A chat with an image, rendered by the plugin (the tokenizer mode's format), goes through vLLM's own GLM5Next
    processor and through the plugin's: the same expanded prompt, placeholder ranges, patch grid and number of pixel
    rows."""
    from PIL import Image

    from tests.vllm_glm5next import summarize
    from vllm_glm53 import testing

    ckpt, prompt, processed = handoff
    pixels, theirs = processed[size]
    ours_processor = testing.multimodal_processor(ckpt, max_model_len=4096, limit_mm_per_prompt={"image": 1, "video": 0})
    ours = summarize(ours_processor(prompt, ours_processor.info.parse_mm_data({"image": [Image.fromarray(pixels)]}),
                                    hf_processor_mm_kwargs={}))
    assert ours == theirs
    # and the layout is the one the prompt asked for: one placeholder run, as many rows as the grid's merged patches
    (offset, length), = ours["placeholders"]
    t, h, w = ours["image_grid_thw"]
    assert ours["pixel_rows"] == t * h * w and length >= t * h * w // 4


def test_expert_parallel_across_data_parallel_is_served_with_unquantized_or_cpu_fp8_experts():
    """EP over DP x TP ranks is the plugin's (model/moe.py exchanges the DP ranks' tokens); what stays refused is EP
    with experts some other quantized kernel keeps whole (w8a8 on Ascend), naming the flag."""
    dp_ep = dict(expert_parallel=True, data_parallel_size=2)
    assert serving.refusals(serving.PLUGIN_MODEL, serving.ServeOptions(**dp_ep, platform="cpu")) == []
    assert serving.refusals(serving.PLUGIN_MODEL, serving.ServeOptions(**dp_ep, platform="cpu",
                                                                       quantization="fp8")) == []
    refused = serving.refusals(serving.PLUGIN_MODEL, serving.ServeOptions(**dp_ep, platform="npu",
                                                                          quantization="ascend"))
    assert len(refused) == 1 and refused[0].startswith("--enable-expert-parallel with quantization ascend")
