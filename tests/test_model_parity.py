"""End-to-end parity: vLLM + the plugin against transformers' ``generate`` on the same float32 checkpoints.

The prompts range from 3 tokens to many times ``index_topk`` (8 in the tiny config, 2 pools of 4), so sparse
selection really drops positions. The mixed batch below (``LENGTHS``, run with ``max_num_seqs=3`` so that steps mix
prefills of new prompts with decodes of running ones) is served on the nested (released) layout by
tests/test_vision_engine.py's zero-limits run and with the reference ops by tests/test_ops_reference_engine.py;
this module covers the released layer schedule and bfloat16 (the flat layout: tests/test_fp8_cpu.py's ragged FP8
run).
"""

import pytest

from conftest import hf_greedy, hf_model, probe, prompt_set, run_engine

pytestmark = pytest.mark.engine

LENGTHS = [3, 9, 24, 41, 77, 130, 190, 260]
MAX_TOKENS = [16, 12, 16, 10, 16, 14, 16, 12]
# Greedy tokens must be identical. Logprobs differ only by float32 summation order (chunked vs token-wise
# recurrence, absorbed vs expanded attention): measured max |diff| ~1e-5 on these checkpoints.
LOGPROB_ATOL = 2e-4
ROUTER_PROBES = [f"model.layers.{i}.mlp.gate.weight.dtype" for i in (1, 4)]  # the first and last MoE blocks


def assert_parity(got, want, atol=LOGPROB_ATOL):
    assert len(got) == len(want), f"{len(got)} outputs for {len(want)} prompts"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["token_ids"] == w["token_ids"], f"prompt {i}: vLLM {g['token_ids']} != transformers {w['token_ids']}"
        # one logprob per generated token on both sides, so the comparison below covers every token
        assert len(g["logprobs"]) == len(w["logprobs"]) == len(w["token_ids"]), f"prompt {i}: logprob counts"
        diffs = [abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"])]
        assert max(diffs) < atol, f"prompt {i}: logprob differences {diffs}"


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


# bf16 statistics against transformers' bf16 run on the same checkpoint (see the test's docstring for the values)
# 16 MLA heads in the bfloat16 checkpoint (the tiny default has 4): from 16 on, a CPU with AMX tiles runs the sparse
# attention on them (csrc/sparse_mla.cpp attend_tiles), so this test covers that path end to end there.
BF16_HEADS = {"num_attention_heads": 16, "num_key_value_heads": 16}
MEDIAN_RATIO = 1.5
MEAN_RATIO = 1.5
AGREE_MARGIN = 0.05


def _teacher_forced(model, sequences):
    """float32 log-softmax over the vocabulary at every position of each sequence (one forward each)."""
    import torch

    out = []
    for seq in sequences:
        with torch.no_grad():
            out.append(torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1))
    return out


def _prompt_stats(prompts, per_prompt, reference):
    """Over every prompt position after the first: |logprob of the prompt's next token - float32's| (nats) and
    whether the most likely token is float32's. ``per_prompt``: [[logprob, top-1 id] per position] per prompt."""
    errors, agree = [], []
    for prompt, rows, ref in zip(prompts, per_prompt, reference):
        assert len(rows) == len(prompt) - 1
        for i, (lp, top) in enumerate(rows):
            errors.append(abs(lp - ref[i, prompt[i + 1]].item()))
            agree.append(top == int(ref[i].argmax()))
    return errors, sum(agree) / len(agree)


def test_bf16_checkpoint_agrees_with_float32_reference(tiny_ckpt):
    """bf16 cannot be token-exact with a float32 reference, and on a tiny random model the largest single error
    is a property of the CPU (which near-tied sparse selection bf16 rounding flips): it was 0.59 nats for
    transformers and 0.90 for the plugin on one AVX2 machine, bounds on it held on one CPU and not another. So
    the plugin's bf16 run is compared with transformers' bf16 run on statistics that settle: teacher-forced on
    the prompts' own tokens (726 positions), the median and mean logprob error against float32 and how often
    the most likely token is float32's, and, for the decode path, the median error of the generated tokens'
    logprobs against float32.

    Measured (AVX2 EPYC): plugin prompt median 0.018 / mean 0.056 nats / top-1 agreement 0.844, generated
    median 0.018; transformers bf16 0.028 / 0.068 / 0.800. The bounds leave the plugin 1.5x transformers' error
    (it is at 0.67x / 0.82x) and 5 points of agreement. With the KDA output norm's weight dropped the plugin
    measured 0.238 / 0.283 / 0.309 (generated 0.286) and fails every bound. A bug whose float32 effect is below
    bf16 rounding cannot show here: dropping the MLA q_a norm entirely moved the plugin to 0.027 / 0.065 / 0.807,
    transformers' own level; the float32 tests above catch that one token for token. (Those numbers are from the
    checkpoint's earlier 4 MLA heads.) With 16 (BF16_HEADS), on an Intel Xeon with AMX: the sparse attention on
    the tiles 0.0249 / 0.0768 / 0.792 (generated 0.0243), on the float32 path (VLLM_GLM53_CPU_AMX=0) 0.0248 /
    0.0764 / 0.798; transformers bf16 0.0242 / 0.0726 / 0.792; the tiles' weight transposition broken: 0.097 /
    0.142 / 0.621, failing.
    """
    import statistics

    path = tiny_ckpt("bf16", dtype="bfloat16", overrides=BF16_HEADS)
    prompts = prompt_set(path, LENGTHS)
    ours, workers = run_engine(path, prompts, 12, engine={"dtype": "bfloat16"}, logprobs=1, ignore_eos=True,
                               prompt_logprobs=True, probe=probe("model_attributes", paths=ROUTER_PROBES))
    assert len(ours) == len(prompts)
    # the router weight (bfloat16 in the checkpoint) is held in float32, not widened again every step
    assert [set(w.values()) for w in workers] == [{"torch.float32"}], workers
    hf_bf16 = _teacher_forced(hf_model(path, dtype="bfloat16"), prompts)
    theirs = [[[lp[i, p[i + 1]].item(), int(lp[i].argmax())] for i in range(len(p) - 1)]
              for p, lp in zip(prompts, hf_bf16)]
    ref = _teacher_forced(hf_model(path, dtype="float32"), [p + o["token_ids"] for p, o in zip(prompts, ours)])
    errors, agree = _prompt_stats(prompts, [o["prompt_logprobs"] for o in ours], ref)
    hf_errors, hf_agree = _prompt_stats(prompts, theirs, ref)
    decode = [abs(lp - r[len(p) - 1 + j, t].item())
              for p, o, r in zip(prompts, ours, ref)
              for j, (t, lp) in enumerate(zip(o["token_ids"], o["logprobs"]))]
    assert len(decode) == 12 * len(prompts)
    median, mean, hf_median, hf_mean = (statistics.median(errors), statistics.mean(errors),
                                        statistics.median(hf_errors), statistics.mean(hf_errors))
    print(f"bf16 vs float32 (nats): plugin prompt median {median:.4f} mean {mean:.4f} top-1 {agree:.3f}, "
          f"generated median {statistics.median(decode):.4f}; transformers bf16 prompt median {hf_median:.4f} "
          f"mean {hf_mean:.4f} top-1 {hf_agree:.3f}")
    assert median <= MEDIAN_RATIO * hf_median
    assert mean <= MEAN_RATIO * hf_mean
    assert agree >= hf_agree - AGREE_MARGIN
    assert statistics.median(decode) <= MEDIAN_RATIO * hf_median
