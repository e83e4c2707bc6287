"""End-to-end parity: vLLM + the plugin against transformers' ``generate`` on the same float32 checkpoints.

The prompts range from 3 tokens to many times ``index_topk`` (8 in the tiny config, 2 pools of 4), so sparse
selection really drops positions, and run as one batch with ``max_num_seqs=3`` so that steps mix prefills
of new prompts with decodes of running ones.
"""

import pytest

from conftest import hf_greedy, hf_model, prompt_set, run_engine

pytestmark = pytest.mark.engine

LENGTHS = [3, 9, 24, 41, 77, 130, 190, 260]
MAX_TOKENS = [16, 12, 16, 10, 16, 14, 16, 12]
# Greedy tokens must be identical. Logprobs differ only by float32 summation order (chunked vs token-wise
# recurrence, absorbed vs expanded attention): measured max |diff| ~1e-5 on these checkpoints.
LOGPROB_ATOL = 2e-4


def assert_parity(got, want, atol=LOGPROB_ATOL):
    assert len(got) == len(want), f"{len(got)} outputs for {len(want)} prompts"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["token_ids"] == w["token_ids"], f"prompt {i}: vLLM {g['token_ids']} != transformers {w['token_ids']}"
        # one logprob per generated token on both sides, so the comparison below covers every token
        assert len(g["logprobs"]) == len(w["logprobs"]) == len(w["token_ids"]), f"prompt {i}: logprob counts"
        diffs = [abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"])]
        assert max(diffs) < atol, f"prompt {i}: logprob differences {diffs}"


@pytest.fixture(scope="module")
def nested(tiny_ckpt):
    path = tiny_ckpt("default")
    prompts = prompt_set(path, LENGTHS)
    return path, prompts, hf_greedy(hf_model(path), prompts, MAX_TOKENS)


def test_nested_mixed_batch_matches_transformers(nested):
    path, prompts, want = nested
    got = run_engine(path, prompts, MAX_TOKENS, engine={"max_num_seqs": 3}, logprobs=1)
    assert_parity(got, want)


def test_tensor_parallel_2_matches_transformers(nested):
    path, prompts, want = nested
    got = run_engine(path, prompts, MAX_TOKENS, engine={"tensor_parallel_size": 2}, logprobs=1,
                     env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert_parity(got, want)


def test_flat_checkpoint_matches_transformers(tiny_ckpt):
    path = tiny_ckpt("flat", layout="flat", seed=1)
    prompts = prompt_set(path, LENGTHS[::2])
    want = hf_greedy(hf_model(path), prompts, 12)
    got = run_engine(path, prompts, 12, logprobs=1)
    assert_parity(got, want)


def test_released_layer_pattern_matches_transformers(tiny_ckpt):
    """The released schedule (every 4th layer sparse MLA, every MLA layer with its own ``full`` indexer),
    a wider top-k and pool, and a second sparse layer after KDA layers."""
    overrides = {
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3 + ["deepseek_sparse_attention"]
        + ["linear_attention"] * 3 + ["deepseek_sparse_attention"],
        "mlp_layer_types": ["dense"] * 2 + ["sparse"] * 6,
        "indexer_types": ["full"] * 8,
        "index_topk": 16,
        "index_kpool": 8,
    }
    path = tiny_ckpt("released-pattern", overrides=overrides, seed=2)
    prompts = prompt_set(path, [5, 30, 120, 250])
    want = hf_greedy(hf_model(path), prompts, 12)
    got = run_engine(path, prompts, 12, logprobs=1)
    assert_parity(got, want)


def _bf16_errors(ref, prompts, outputs):
    """Teacher-force greedy outputs through the float32 reference: per token, the gap between the chosen token
    and the float32 argmax, and the error of the reported logprob (nats)."""
    import torch

    gaps, errors = [], []
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([prompt + out["token_ids"]])).logits[0].float(), -1)
        for i, (t, olp) in enumerate(zip(out["token_ids"], out["logprobs"])):
            row = lp[len(prompt) - 1 + i]
            gaps.append((row.max() - row[t]).item())
            errors.append(abs(row[t].item() - olp))
    return gaps, errors


def test_bf16_checkpoint_agrees_with_float32_reference(tiny_ckpt):
    """bf16 cannot be token-exact with a float32 reference: on a tiny random model, bf16 rounding flips near-tied
    sparse selections, and transformers' own bf16 run drifts by up to ~0.9 nats on these prompts. So the
    plugin's bf16 error against float32 is measured next to transformers' bf16 error on the same checkpoint,
    and must not be worse than it by more than a small margin. Measured (8 prompts x 12 tokens): plugin mean
    argmax gap 0.050 / logprob error 0.071 nats, transformers bf16 0.027 / 0.066; both max ~0.9."""
    import statistics

    path = tiny_ckpt("bf16", dtype="bfloat16")
    prompts = prompt_set(path, LENGTHS)
    ref = hf_model(path, dtype="float32")
    ours = run_engine(path, prompts, 12, engine={"dtype": "bfloat16"}, logprobs=1, ignore_eos=True)
    theirs = hf_greedy(hf_model(path, dtype="bfloat16"), prompts, 12)
    gaps, errors = _bf16_errors(ref, prompts, ours)
    hf_gaps, hf_errors = _bf16_errors(ref, prompts, theirs)
    print(f"bf16 vs float32 (nats): plugin gap max {max(gaps):.3f} mean {statistics.mean(gaps):.4f}, logprob "
          f"error max {max(errors):.3f} mean {statistics.mean(errors):.4f}; transformers bf16: gap max "
          f"{max(hf_gaps):.3f} mean {statistics.mean(hf_gaps):.4f}, error max {max(hf_errors):.3f} mean "
          f"{statistics.mean(hf_errors):.4f}")
    assert statistics.mean(gaps) <= 2 * statistics.mean(hf_gaps) + 0.02
    assert statistics.mean(errors) <= 2 * statistics.mean(hf_errors) + 0.02
    assert max(gaps) <= max(hf_gaps) + 0.3
    assert max(errors) <= max(hf_errors) + 0.3
