"""MTP speculative decoding with the checkpoint's own draft layer.

Greedy outputs with speculation must be exactly the outputs without it: every rejected draft rolls the KDA
recurrent and conv state back to the state after the last accepted token (per-position state slots), and
the latent cache rows of rejected tokens are overwritten. On a random checkpoint almost every draft is
wrong, so these runs exercise rejection on nearly every step.
"""

import shutil

import pytest

from conftest import greedy_reference, hf_greedy, hf_model, prompt_set, run_engine
from vllm_glm53.tiny import make_exact_mtp

pytestmark = pytest.mark.engine

LENGTHS = [3, 9, 24, 41, 77, 130, 190, 260]
MAX_TOKENS = [16, 12, 16, 10, 16, 14, 16, 12]


def _acceptance(metrics):
    drafts = metrics.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
    return accepted / drafts if drafts else 0.0


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    return greedy_reference(tiny_ckpt("default"), LENGTHS, MAX_TOKENS)


@pytest.mark.parametrize("method,n", [("mtp", 3)])
def test_speculation_keeps_greedy_outputs(reference, method, n):
    path, prompts, want = reference
    got, metrics = run_engine(path, prompts, MAX_TOKENS, metrics=True, engine={
        "max_num_seqs": 4, "enable_prefix_caching": False,
        "speculative_config": {"method": method, "num_speculative_tokens": n}})
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["token_ids"] == w["token_ids"], f"prompt {i} with {method} n={n}"
    assert metrics["vllm:spec_decode_num_drafts"] > 0  # speculation really ran
    print(f"{method} n={n}: acceptance {_acceptance(metrics):.2f} on a random draft layer")


def test_exact_drafts_are_accepted_and_save_steps(tiny_ckpt, tmp_path):
    path = tmp_path / "exact-mtp"
    shutil.copytree(tiny_ckpt("default"), path)
    make_exact_mtp(path)
    prompts = prompt_set(path, [5, 30, 120])
    want = hf_greedy(hf_model(path), prompts, 24)
    got, metrics = run_engine(path, prompts, 24, metrics=True, engine={
        "enable_prefix_caching": False, "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}})
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]
    acceptance = _acceptance(metrics)
    tokens = sum(len(g["token_ids"]) for g in got)
    steps = metrics["vllm:spec_decode_num_drafts"]  # one verification step per request per draft round
    print(f"exact draft layer: acceptance {acceptance:.3f}, {tokens} tokens in {steps} draft rounds")
    assert acceptance > 0.95
    assert steps < tokens / 2
