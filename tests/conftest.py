"""Shared fixtures: tiny checkpoints (built once per session), the transformers reference, and a runner that
serves prompts through vLLM + the plugin in a separate process."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only what will run counts
def pytest_collection_modifyitems(config, items):
    """Slow work that tests wait for but that depends on no other test starts in the background, at the lowest CPU
    priority, as soon as the run's tests are known: a module's ``start_in_background()`` (once, where any of its
    tests will run), and the emulated avx512 library (kernel_isas.start_emulated_build); the tests that wait for
    them go last, so that the work is done by the time they run. The suite keeps about 0.8 of a 2-core machine idle
    on average (engine start-ups are mostly one process importing), and these jobs ran in line for ~3.5 minutes of
    it (the Triton interpreter run's tests, waiting in alphabetical order, for ~50 s of a Zen 3 run)."""
    if config.option.collectonly:
        return
    background = set()
    for module in dict.fromkeys(item.module for item in items if hasattr(item, "module")):
        if hasattr(module, "start_in_background"):
            module.start_in_background()
            background.add(module)
    waiting = [item for item in items if getattr(item, "module", None) in background]
    emulated = [item for item in items if item.nodeid.endswith("[avx512-emulated]")  # kernel_isas.EMULATED
                and not item.get_closest_marker("skip")]
    last = waiting + emulated
    items[:] = [item for item in items if item not in last] + last
    if emulated:
        import kernel_isas

        kernel_isas.start_emulated_build()


@pytest.fixture
def compiled_kernels():
    """For the compiled-kernel test modules (``pytestmark = pytest.mark.usefixtures("compiled_kernels")``): skip
    without a compiler, fail where one exists and the kernels are not loaded (kernel_isas.require_kernels)."""
    from kernel_isas import require_kernels

    require_kernels()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Builds tiny checkpoints on demand, each once per session: ``tiny_ckpt(name, **build_kwargs)``."""
    from vllm_glm53.tiny import build_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    built: dict[str, Path] = {}

    def get(name: str = "default", **kwargs) -> Path:
        if name not in built:
            built[name] = build_checkpoint(root / name, **kwargs)
        return built[name]

    return get


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The plugin's ``glm5_next`` tokenizer over the tiny checkpoint's BPE with all GLM added tokens (the parser
    tests tokenise model outputs with it); a module may define its own ``tok``."""
    import vllm_glm53
    from vllm_glm53.chat.tokenizer import Glm5NextTokenizer
    from vllm_glm53.tiny import write_tokenizer

    path = tmp_path_factory.mktemp("glm_tokenizer")
    write_tokenizer(path)
    vllm_glm53.register()
    return Glm5NextTokenizer.from_pretrained(str(path))


class EngineRunError(AssertionError):
    """The engine process failed; ``stderr`` holds its whole log (vLLM logs to stdout; both are merged)."""

    def __init__(self, returncode: int, stderr: str) -> None:
        super().__init__(f"engine run failed (rc={returncode}):\n{stderr[-6000:]}")
        self.stderr = stderr


def run_engine(model, prompts, max_tokens, engine=None, logprobs=0, ignore_eos=False, timeout=900,
               env=None, metrics=False, prompt_logprobs=False, conversation=None, probe=None):
    """Greedy generation through ``vllm.LLM`` in a fresh process; returns token ids (and logprobs) per prompt,
    and with ``probe`` (a function of ``vllm_glm53.testing`` and its keyword arguments, see :func:`probe`) also
    what it returns for each worker's model: ``(results, [result per worker])``; with ``conversation``
    (``{"turns": [ids, ...], "max_tokens": n}``, see engine_runner.py) the same engine then holds that
    conversation: ``(results, turns)``; with ``metrics=True`` the engine's counters: ``(results, {name: value})``.
    With several of these, ``(results, probe, turns, counters)``, those asked for, in that order."""
    import tempfile

    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    with tempfile.TemporaryDirectory() as d:
        spec, out = Path(d) / "spec.json", Path(d) / "out.json"
        spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "max_tokens": max_tokens,
                                    "engine": engine or {}, "logprobs": logprobs, "ignore_eos": ignore_eos,
                                    "metrics": metrics, "prompt_logprobs": prompt_logprobs,
                                    "conversation": conversation, **({"probe": probe} if probe else {})}))
        proc = subprocess.run([sys.executable, str(TESTS / "engine_runner.py"), str(spec), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        if proc.returncode != 0:
            raise EngineRunError(proc.returncode, proc.stdout)
        results = json.loads(out.read_text())
        extras = [results["probe"]] if probe else []
        if probe:
            results = results["outputs"]
        if conversation:
            extras.append(json.loads(Path(str(out) + ".conversation.json").read_text()))
        if metrics:
            extras.append(json.loads(Path(str(out) + ".metrics.json").read_text()))
        return (results, *extras) if extras else results


def probe(name: str, **kwargs) -> dict:
    """An engine-run probe: ``vllm_glm53.testing.<name>(model, **kwargs)`` on every worker's model."""
    return {"function": f"vllm_glm53.testing.{name}", "kwargs": kwargs}


@contextlib.contextmanager
def served(path, extra_args: tuple[str, ...] = (), features: tuple[str, ...] = (), env: dict | None = None):
    """``vllm serve`` of ``path`` with the CPU recipe's flags on a free local port, healthy, stopped on exit:
    ``{"url", "path", "server"}`` (one server per test module: use it in a module-scoped fixture). ``env``
    overrides the recipe's environment."""
    from vllm_glm53.demo import Server, free_port, serve_command

    port = free_port()
    argv, recipe_env = serve_command(path, port, extra_args=tuple(extra_args), features=tuple(features))
    env = {**recipe_env, **(env or {})}
    srv = Server(argv, env, echo=False)
    url = f"http://127.0.0.1:{port}"
    try:
        srv.wait_healthy(url, timeout=600)
        yield {"url": url, "path": path, "server": srv}
    finally:
        srv.stop()


def hf_model(path, dtype="float32"):
    """transformers' own model on the same checkpoint (flat checkpoints need the documented key mapping)."""
    import torch
    from transformers import Glm5NextForConditionalGeneration

    cfg = json.loads((Path(path) / "config.json").read_text())
    # transformers' grouped expert GEMM has no float64 form; its per-expert loop does the same products
    kwargs = {"experts_implementation": "eager"} if dtype == "float64" else {}
    if "text_config" not in cfg:
        kwargs["key_mapping"] = {r"^model\.(?!language_model\.|visual\.)": "model.language_model."}
    model = Glm5NextForConditionalGeneration.from_pretrained(str(path), dtype=getattr(torch, dtype), **kwargs)
    return model.eval()


def hf_greedy(model, prompts, max_tokens) -> list[dict]:
    """transformers ``generate`` (greedy), one prompt at a time; token ids and the chosen tokens' logprobs."""
    import torch

    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    results = []
    for prompt, n in zip(prompts, max_tokens):
        ids = torch.tensor([prompt])
        kwargs = dict(max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        tokens = out.sequences[0, len(prompt):].tolist()
        lps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, tokens)]
        results.append({"token_ids": tokens, "logprobs": lps})
    return results


def greedy_reference(path, lengths, max_tokens) -> tuple:
    """``(path, prompts, transformers' greedy outputs)`` for prompts of ``lengths`` on checkpoint ``path``: what
    the engine parity tests compare against (build it in a module-scoped fixture)."""
    prompts = prompt_set(path, lengths)
    return path, prompts, hf_greedy(hf_model(path), prompts, max_tokens)


def prompt_set(tokenizer_dir, lengths) -> list[list[int]]:
    """Token-id prompts of the given lengths cut from the shipped corpus (different starting points)."""
    from importlib import resources

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = resources.files("vllm_glm53.data").joinpath("tiny_corpus.txt").read_text()
    ids = tok.encode(text * 4, add_special_tokens=False)
    return [ids[(97 * i) % 700 : (97 * i) % 700 + n] for i, n in enumerate(lengths)]
