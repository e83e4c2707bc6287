"""The plain-torch reference ops stay a working engine path: the nested parity run (mixed prefills and decodes,
prompts far beyond index_topk) with the compiled kernels switched off (``VLLM_GLM53_CPU_KERNELS=0``), so the
reference forms the kernels are tested against are themselves held to transformers, end to end."""

import pytest

from conftest import greedy_reference, run_engine
from test_model_parity import LENGTHS, MAX_TOKENS, assert_parity

pytestmark = pytest.mark.engine


def test_torch_ops_engine_matches_transformers(tiny_ckpt):
    path, prompts, want = greedy_reference(tiny_ckpt("default"), LENGTHS, MAX_TOKENS)
    got = run_engine(path, prompts, MAX_TOKENS, engine={"max_num_seqs": 3}, logprobs=1,
                     env={"VLLM_GLM53_CPU_KERNELS": "0"})
    assert_parity(got, want)
