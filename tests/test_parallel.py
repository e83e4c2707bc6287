"""Beyond one process group: pipeline parallel over Ray across two nodes (with MTP drafts) and expert parallel
for the plugin's model, each against transformers on the same float32 checkpoint: a batch of prompts from 3 to 190
tokens (index_topk is 8, so sparse selection drops positions), ``max_num_seqs`` 3 so that steps mix prefills with
decodes, every generated token's logprob compared. Pipeline parallel under vLLM's own process executor, with the
indexer's selection crossing the stage boundary and images on the first stage, runs in tests/test_vision_engine.py.

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


def test_tensor_parallel_2_with_expert_parallel_matches_transformers(reference):
    """``--enable-expert-parallel`` over TP 2: each rank holds 4 of the 8 experts whole (rank 0 experts 0-3, rank 1
    experts 4-7, in every MoE block), attention and the shared expert stay tensor-parallel."""
    path, prompts, want = reference
    got, sizes = run_engine(path, prompts, MAX_TOKENS, logprobs=1, probe=probe("parameter_bytes"),
                            engine={"tensor_parallel_size": 2, "enable_expert_parallel": True, "max_num_seqs": 3},
                            env=BIND_2)
    assert_parity(got, want)
    assert [(s["experts_per_block"], s["first_experts"]) for s in sizes] == [([4], [0]), ([4], [4])]


@pytest.fixture(scope="module")
def two_node_ray_cluster():
    """A Ray cluster of two nodes on this machine (Ray's own local-cluster utility: a head and a second raylet),
    each offering one CPU rank (``vllm_cpu_rank``, ledger 8 in vllm_glm53/_vllm.py), so PP 2 must place one stage
    on each node; each node's environment binds its rank to its own core, as the recipe does per server."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from vllm_glm53._vllm import CPU_RAY_RESOURCE

    def node(core: int) -> dict:
        return {"num_cpus": 1, "resources": {CPU_RAY_RESOURCE: 1}, "env_vars": {"VLLM_CPU_OMP_THREADS_BIND": str(core)}}

    cluster = Cluster(initialize_head=True, head_node_args=node(0))
    cluster.add_node(**node(1))
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


def test_pipeline_parallel_2_over_ray_on_two_nodes_with_mtp_and_prefix_caching_matches_transformers(
        drafting, two_node_ray_cluster):
    """PP 2 over Ray, one stage per node, split 2 | 3 so both stages hold KDA layers and vLLM's prefix caching (its
    default: KDA state snapshots at block edges) runs on both, with MTP drafts (the draft layer on the last stage;
    steps run one at a time, adapter ledger 10); then a 3-turn conversation (each turn's prompt = the previous
    prompt + reply + a new message) reuses the earlier turns' blocks, every turn equal to transformers."""
    path, prompts, want = drafting
    turns = prompt_set(path, CONVERSATION_TURNS)
    got, sizes, conversation, metrics = run_engine(
        path, prompts, MAX_TOKENS, logprobs=1, probe=probe("parameter_bytes"), metrics=True,
        conversation={"turns": turns, "max_tokens": CONVERSATION_REPLY},
        engine={"pipeline_parallel_size": 2, "distributed_executor_backend": "ray", "max_num_seqs": 3,
                "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
        env={"RAY_ADDRESS": two_node_ray_cluster.address, "VLLM_PP_LAYER_PARTITION": "2,3"})
    assert_parity(got, want)
    assert [s["layers"] for s in sizes] == [[0, 1], [2, 3, 4]]
    nodes = [s["ray_node"] for s in sizes]
    assert None not in nodes and len(set(nodes)) == 2, f"stages ran on Ray nodes {nodes}"
    # each rank bound to its node's core: the main thread's mask, one compute thread, every thread started since
    binding = {s["ray_node"]: s["cpu_binding"] for s in sizes}
    assert binding[two_node_ray_cluster.head_node.node_id]["cpus"] == [0], binding
    assert sorted(b["cpus"] for b in binding.values()) == [[0], [1]], binding
    assert all(b["mask"] == b["cpus"] and b["threads"] == 1 and b["loose_threads"] == 0 for b in binding.values())
    acceptance = metrics["vllm:spec_decode_num_accepted_tokens"] / metrics["vllm:spec_decode_num_draft_tokens"]
    print(f"PP 2 over Ray with MTP: acceptance {acceptance:.2f}")
    assert 0.2 < acceptance < 0.95  # drafts partly accepted: some steps keep every draft, some roll back
    model = hf_model(path)
    assert_parity(conversation, hf_greedy(model, [t["prompt_token_ids"] for t in conversation], CONVERSATION_REPLY))
    for i, turn in enumerate(conversation[1:], start=1):
        # reused up to the previous prompt's last block edge before its last token (align mode, block 128)
        reusable = (len(conversation[i - 1]["prompt_token_ids"]) - 1) // 128 * 128
        assert turn["prefix_cache_hits"] >= reusable > 0, f"turn {i + 1}: {turn['prefix_cache_hits']} hits"
