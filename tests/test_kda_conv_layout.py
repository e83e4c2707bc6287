"""The KDA layer's short-conv states in both of vLLM's layouts.

vLLM stores a slot's conv window tap after tap (``[K-1, C]``, its "SD" layout and default) or channel after
channel (``[C, K-1]``, "DS": NIXL transfers, ``VLLM_SSM_CONV_STATE_LAYOUT=DS``). The layer declares the layout
vLLM uses (``kda_state_shapes``) and hands the ops a ``[N, C, K-1]`` view of either; the compiled conv reads and
writes tap after tap as vectors in place and transposes channel after channel. The same steps (prefill, decode,
speculative verification) must give the same outputs and leave the same windows in both.
"""

from __future__ import annotations

import pytest
import torch

from test_mtp_partial import N_DRAFTS, PROMPT, _decode, _prefill, _verify, kda_layer  # noqa: F401 (fixture)
from vllm_glm53 import _vllm
from vllm_glm53.model import kda as kda_model


@pytest.mark.parametrize("taps_first", [True, False])
def test_state_shapes_follow_vllms_conv_layout(kda_layer, monkeypatch, taps_first):
    _, arch, _ = kda_layer
    monkeypatch.setattr(_vllm, "conv_state_taps_first", lambda: taps_first)
    (conv, state) = kda_model.kda_state_shapes(arch, 1)
    C, taps = 3 * arch.linear_num_heads * arch.linear_head_dim, arch.conv_kernel - 1
    assert conv == ((taps, C) if taps_first else (C, taps))
    assert state == (arch.linear_num_heads, arch.linear_head_dim, arch.linear_head_dim)


def test_the_adapter_reads_vllms_conv_layout(monkeypatch):
    """Tap after tap by default (vLLM 0.32's CPU platform asks for "SD", or leaves vLLM's default, also "SD"),
    channel after channel where vLLM is told "DS" (as it tells itself for NIXL transfers)."""
    from vllm.model_executor.layers.mamba import mamba_utils

    layouts = {}
    try:
        for value in (None, "SD", "DS"):
            if value is None:
                monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
            else:
                monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", value)
            mamba_utils.get_conv_state_layout.cache_clear()  # vLLM reads the variable once per process
            layouts[value] = _vllm.conv_state_taps_first()
    finally:
        monkeypatch.undo()
        mamba_utils.get_conv_state_layout.cache_clear()
    assert layouts == {None: True, "SD": True, "DS": False}


def _steps(layer, arch, taps_first, monkeypatch):
    """Prefill two sequences, decode one, verify drafts on the other; the outputs, every slot's conv window as
    ``[C, K-1]`` and recurrent state afterwards, and the windows the slots started from."""
    monkeypatch.setattr(layer, "conv_taps_first", taps_first)
    gen = torch.Generator().manual_seed(3)
    C, taps = 3 * arch.linear_num_heads * arch.linear_head_dim, arch.conv_kernel - 1
    windows = torch.randn(8, C, taps, generator=gen)  # slots nobody writes keep random values
    conv = windows.transpose(1, 2).contiguous() if taps_first else windows.clone()
    state = torch.randn(8, arch.linear_num_heads, arch.linear_head_dim, arch.linear_head_dim, generator=gen)
    layer.kv_cache = (conv, state)
    D = arch.hidden_size
    xs = torch.randn(2 * PROMPT + 1 + 2 * (N_DRAFTS + 1), D, generator=torch.Generator().manual_seed(4))
    a, b, step1, step2 = xs.split([PROMPT, PROMPT + 1, N_DRAFTS + 1, N_DRAFTS + 1])
    spec_slots = [5, 1, 7, 3]
    outs = [_prefill(layer, a, spec_slots[0]), _prefill(layer, b[:PROMPT], 6), _decode(layer, b[PROMPT:], 6)]
    outs += _verify(layer, b[PROMPT:], step1, 6, spec_slots, accepted=1)
    outs += _verify(layer, b[PROMPT:], step2, 6, spec_slots, accepted=3)
    return outs, (conv.transpose(1, 2) if taps_first else conv), state, windows


def test_kda_layer_gives_the_same_steps_in_both_conv_layouts(kda_layer, monkeypatch):
    layer, arch, _ = kda_layer
    outs_sd, conv_sd, state_sd, start = _steps(layer, arch, True, monkeypatch)
    outs_ds, conv_ds, state_ds, _ = _steps(layer, arch, False, monkeypatch)
    for got, want in zip(outs_sd, outs_ds):
        assert torch.equal(got, want)  # the same sums in the same order: only where the window lives differs
    assert torch.equal(conv_sd, conv_ds)
    assert torch.equal(state_sd, state_ds)
    # the steps really moved windows: the written slots differ from their random start, the others do not
    changed = [s for s in range(8) if not torch.equal(conv_sd[s], start[s])]
    assert changed == [1, 3, 5, 6, 7]
