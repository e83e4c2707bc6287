"""Beyond one process group: TP 2 x PP 2 over Ray across two nodes (with MTP drafts), expert parallel over TP, and
expert parallel across data-parallel engines (``vllm serve``) for the plugin's model, each against transformers on
the same float32 checkpoint: prompts from 3 to 190 tokens (index_topk is 8, so sparse selection drops positions), in
the ``LLM`` runs ``max_num_seqs`` 3 so that steps mix prefills with decodes, every generated token's logprob
compared. Pipeline parallel under vLLM's own process executor, with the indexer's selection crossing the stage
boundary and images on the first stage, runs in tests/test_vision_engine.py.

Engine starts dominate the cost (about a minute each on 2 idle cores), so each scenario is one engine.
"""

import shutil

import pytest

from conftest import greedy_reference, hf_greedy, hf_model, probe, prompt_set, run_engine
from test_model_parity import assert_parity
from vllm_glm53.tiny import make_exact_mtp

pytestmark = pytest.mark.engine

LENGTHS = [3, 24, 77, 190]
MAX_TOKENS = [12, 8, 12, 10]
BIND_2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank
CONVERSATION_TURNS, CONVERSATION_REPLY = [300, 100, 100], 6  # new message tokens per turn; tokens per reply


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    return greedy_reference(tiny_ckpt("default"), LENGTHS, MAX_TOKENS)


@pytest.fixture(scope="module")
def dp_ep_server(reference):
    """``vllm serve --data-parallel-size 2 --enable-expert-parallel`` (the CPU recipe's flags, one core per DP rank),
    with vLLM's dev endpoints (``VLLM_SERVER_DEV_MODE``) for the weight checksums."""
    from conftest import served

    with served(reference[0], ("--data-parallel-size", "2", "--enable-expert-parallel", "--api-server-count", "1"),
                env={**BIND_2, "VLLM_SERVER_DEV_MODE": "1"}) as server:
        yield server


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    import requests

    from vllm_glm53.demo import SERVED_NAME

    r = requests.post(f"{url}/v1/completions", timeout=600, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


def _expected_expert_digests(path, layer: int, first: int, count: int) -> dict[str, str]:
    """sha256 of the stacked expert tensors a rank holding experts ``[first, first + count)`` of MoE block
    ``layer`` must have (``w13`` rows gate | up, ``w2`` down), built from the checkpoint."""
    import hashlib

    import torch
    from safetensors import safe_open

    def digest(t):
        return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        def w(e, which):
            return f.get_tensor(f"model.language_model.layers.{layer}.mlp.experts.{e}.{which}.weight")

        experts = range(first, first + count)
        return {"w13": digest(torch.stack([torch.cat([w(e, "gate_proj"), w(e, "up_proj")]) for e in experts])),
                "w2": digest(torch.stack([w(e, "down_proj") for e in experts]))}


def test_data_parallel_2_with_expert_parallel_serves_like_transformers(reference, dp_ep_server):
    """DP 2 x EP: each DP rank holds 4 of the 8 experts whole, and every MoE block exchanges the two ranks' tokens.
    Two request streams at once (a 3-token prompt then the 190-token one; 24 then 77), so both engines run at the
    same time, and, when one stream is between requests or done, the idle engine steps vLLM's dummy batches in
    lockstep with the busy one. Every completion equals transformers' greedy run, token ids and logprobs; both
    engines finished requests (vLLM's per-engine metrics); each rank's expert weights are exactly its half of the
    checkpoint (vLLM's weight checksums, per DP rank). Traced once by hand (every MoE call's token counts): 49
    lockstep steps, prefill steps such as [3, 1], [1, 24], [128, 1] (the 190-token prompt in two chunks), and each
    engine stepped about 27 one-token dummy batches while the other had work."""
    import re
    import threading

    import requests

    path, prompts, want = reference
    url = dp_ep_server["url"]
    got: dict[int, dict] = {}
    failures: list[BaseException] = []

    def stream(indices):
        try:
            for i in indices:
                got[i] = _complete(url, prompts[i], MAX_TOKENS[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=stream, args=(s,)) for s in ([0, 3], [1, 2])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log = "\n".join(dp_ep_server["server"].lines[-80:])
    assert not failures, f"{failures}\n{log}"
    assert_parity([got[i] for i in range(len(prompts))], want)

    finished = {}
    for line in requests.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = re.match(r'vllm:request_success_total\{.*engine="(\d+)".*\} ([0-9.]+)$', line)
        if m:
            finished[m[1]] = finished.get(m[1], 0) + float(m[2])
    assert set(finished) == {"0", "1"} and all(n > 0 for n in finished.values()), f"finished per engine: {finished}"
    assert sum(finished.values()) == len(prompts)

    r = requests.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=60)
    assert r.status_code == 200, r.text
    checksums = r.json()["checksums"]
    stacks = {}
    for key, digest in checksums.items():  # "dp{d}:pp0:pcp0:tp0:<parameter name>"
        m = re.match(r"dp(\d+):.*\.layers\.(\d+)\.mlp\.experts\.(w13|w2)$", key)
        if m:
            stacks[(int(m[1]), int(m[2]), m[3])] = digest
    layers = sorted({layer for _, layer, _ in stacks})
    assert layers and {dp for dp, _, _ in stacks} == {0, 1}, sorted(stacks)
    for layer in layers:
        for dp in (0, 1):
            want_digests = _expected_expert_digests(path, layer, first=4 * dp, count=4)
            for which in ("w13", "w2"):
                assert stacks[(dp, layer, which)] == want_digests[which], f"DP rank {dp} layer {layer} {which}"


@pytest.fixture(scope="module")
def two_node_ray_cluster():
    """A Ray cluster of two nodes on this machine (Ray's own local-cluster utility: a head and a second raylet),
    each offering two CPU ranks (``vllm_cpu_rank``, ledger 8 in vllm_glm53/_vllm.py), so TP 2 x PP 2 places one
    stage on each node; each node's environment binds its two ranks to one core each, as the two-node recipe binds
    one rank per socket."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from vllm_glm53._vllm import CPU_RAY_RESOURCE

    node = {"num_cpus": 2, "resources": {CPU_RAY_RESOURCE: 2}, "env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def drafting(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint with an MTP layer that drafts mostly right (``make_exact_mtp(keep=0.02)``: the main
    model still reads its context, a little), and transformers' greedy outputs on it: steps accept any number of
    drafts, so verification both keeps and rolls back KDA state on both stages."""
    path = tmp_path_factory.mktemp("drafting") / "tiny-drafting"
    shutil.copytree(tiny_ckpt("default"), path)
    make_exact_mtp(path, keep=0.02)
    return greedy_reference(path, LENGTHS, MAX_TOKENS)


def test_tensor_2_by_pipeline_2_over_ray_with_expert_parallel_mtp_and_prefix_caching_matches_transformers(
        drafting, two_node_ray_cluster):
    """The two-node recipe's shape on two simulated nodes: PP 2 over Ray, one stage per node, TP 2 inside each node
    with one rank per core range, and ``--enable-expert-parallel`` over each stage's TP 2 (each rank holds 4 of the
    8 experts whole: experts 0-3 and 4-7 in every MoE block; attention and the shared expert stay tensor-parallel);
    split 2 | 3 so both stages hold KDA layers and vLLM's prefix caching (its default: KDA state snapshots at block
    edges) runs on both; MTP drafts (the draft layer on the last stage; steps run one at a time, adapter ledger 10);
    then a 3-turn conversation (each turn's prompt = the previous prompt + reply + a new message) reuses the earlier
    turns' blocks, every turn equal to transformers."""
    path, prompts, want = drafting
    turns = prompt_set(path, CONVERSATION_TURNS)
    got, ranks, conversation, metrics = run_engine(
        path, prompts, MAX_TOKENS, logprobs=1, probe=probe("parameter_bytes"), metrics=True,
        conversation={"turns": turns, "max_tokens": CONVERSATION_REPLY},
        engine={"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "distributed_executor_backend": "ray",
                "enable_expert_parallel": True, "max_num_seqs": 3,
                "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
        env={"RAY_ADDRESS": two_node_ray_cluster.address, "VLLM_PP_LAYER_PARTITION": "2,3"})
    assert_parity(got, want)
    # ranks in TP-major order: stage 0's two ranks on one node, stage 1's on the other
    assert [r["layers"] for r in ranks] == [[0, 1], [0, 1], [2, 3, 4], [2, 3, 4]]
    assert [(r["experts_per_block"], r["first_experts"]) for r in ranks] == [([4], [0]), ([4], [4])] * 2
    nodes = [r["ray_node"] for r in ranks]
    assert None not in nodes and nodes[0] == nodes[1] != nodes[2] == nodes[3], f"ranks ran on Ray nodes {nodes}"
    # each node's two ranks bound to one core each: the main thread's mask, one compute thread, every thread started
    # since inside the mask
    for pair in (ranks[:2], ranks[2:]):
        bound = [r["cpu_binding"] for r in pair]
        assert sorted(b["cpus"] for b in bound) == [[0], [1]], bound
        assert all(b["mask"] == b["cpus"] and b["threads"] == 1 and b["loose_threads"] == 0 for b in bound), bound
    acceptance = metrics["vllm:spec_decode_num_accepted_tokens"] / metrics["vllm:spec_decode_num_draft_tokens"]
    print(f"TP 2 x PP 2 over Ray with MTP: acceptance {acceptance:.2f}")
    assert 0.2 < acceptance < 0.95  # drafts partly accepted: some steps keep every draft, some roll back
    model = hf_model(path)
    assert_parity(conversation, hf_greedy(model, [t["prompt_token_ids"] for t in conversation], CONVERSATION_REPLY))
    for i, turn in enumerate(conversation[1:], start=1):
        # reused up to the previous prompt's last block edge before its last token (align mode, block 128)
        reusable = (len(conversation[i - 1]["prompt_token_ids"]) - 1) // 128 * 128
        assert turn["prefix_cache_hits"] >= reusable > 0, f"turn {i + 1}: {turn['prefix_cache_hits']} hits"
