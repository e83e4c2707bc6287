"""MTP speculative decoding with the checkpoint's own draft layer: an exact draft layer is accepted and saves
steps, with greedy outputs exactly transformers'.

Rejection (the KDA state rolled back to the slot of the last accepted token, rejected latent rows overwritten) runs
in the partly-right-drafter tests: tests/test_mtp_partial.py (0..N accepted, unit and engine),
tests/test_long_context.py (with prefix caching) and tests/test_parallel.py (TP 2 x PP 2 over Ray).
"""

import shutil

import pytest

from conftest import hf_greedy, hf_model, prompt_set, run_engine
from vllm_glm53.tiny import make_exact_mtp

pytestmark = pytest.mark.engine


def _acceptance(metrics):
    drafts = metrics.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
    return accepted / drafts if drafts else 0.0


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
