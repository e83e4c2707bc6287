"""The vision tower (``vllm_glm53.model.vision``, built from vLLM's parallel layers) against transformers'
``Glm5NextVisionModel`` on the same weights, at tensor-parallel sizes 1 and 2.

The reference tower uses the tiny config's geometry with weights initialised at std 0.1 (features of order
0.1, like token embeddings; the default 0.02 gives features of order 1e-3, too small to expose a wrong rotary
angle or a swapped tensor) and random norm weights and biases.
"""

import multiprocessing
import os
import tempfile

import pytest
import torch

from vllm_glm53 import testing
from vllm_glm53.model.vision import Glm5NextVisionTower, patch_rows_cols, vision_arch
from vllm_glm53.model.weights import CheckpointError

# Two images of different shapes and a 3-frame video, in one batch (the video's frames attend separately).
GRIDS = [(1, 4, 6), (3, 4, 4), (1, 2, 2)]
ATOL = 2e-5  # float32; features have magnitude ~0.1-1


def reference_config():
    from hf_ref import tiny_config_dict
    from transformers import Glm5NextConfig

    cfg = tiny_config_dict()
    cfg["vision_config"]["initializer_range"] = 0.1
    return Glm5NextConfig(**cfg)


def reference_tower(config):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    torch.manual_seed(0)
    model = Glm5NextVisionModel._from_config(config.vision_config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm weights (init 1) and biases (init 0)
                base = 1.0 if name.endswith("weight") and "norm" in name else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
    return model


def reference_output(model, pixels, grids):
    """transformers runs each video frame as its own ``[1, h, w]`` item (``get_video_features``)."""
    flat = [(1, h, w) for t, h, w in grids for _ in range(t)]
    with torch.no_grad():
        return model(pixels, grid_thw=torch.tensor(flat)).pooler_output


def pixels_for(grids, dim):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(2))


def build_tower(config, state_dict):
    tower = Glm5NextVisionTower(vision_arch(config))
    loaded = tower.load_weights(state_dict.items())
    testing.finish_loading(tower)
    return tower, loaded


@pytest.fixture(scope="module")
def reference():
    config = reference_config()
    return config, reference_tower(config)


@pytest.fixture(scope="module")
def tp1():
    with testing.standalone_model_parallel():
        yield


def test_tower_matches_transformers(reference, tp1):
    config, hf = reference
    tower, loaded = build_tower(config, hf.state_dict())
    assert loaded == {n for n, _ in tower.named_parameters()}
    pixels = pixels_for(GRIDS, tower.arch.patch_dim)
    want = reference_output(hf, pixels, GRIDS)
    with torch.no_grad():
        got = tower(pixels, GRIDS)
    assert got.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, config.text_config.hidden_size)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_every_norm_uses_the_config_eps(tp1):
    """Block norms, q/k norms and the post-layernorm take ``vision_config.rms_norm_eps`` as transformers does
    (vLLM's in-tree model hard-codes 1e-6 / 1e-5); a large eps makes any hard-coded value visible."""
    config = reference_config()
    config.vision_config.rms_norm_eps = 0.5
    hf = reference_tower(config)
    tower, _ = build_tower(config, hf.state_dict())
    pixels = pixels_for(GRIDS, tower.arch.patch_dim)
    with torch.no_grad():
        got = tower(pixels, GRIDS)
    torch.testing.assert_close(got, reference_output(hf, pixels, GRIDS), rtol=0, atol=ATOL)


def test_items_are_independent(reference, tp1):
    """An item's features do not depend on what else is in the batch (no attention across items/frames)."""
    config, hf = reference
    tower, _ = build_tower(config, hf.state_dict())
    pixels = pixels_for(GRIDS, tower.arch.patch_dim)
    with torch.no_grad():
        batched = tower(pixels, GRIDS)
        alone = tower(pixels[24:72], [GRIDS[1]])
    torch.testing.assert_close(batched[6:18], alone, rtol=0, atol=1e-6)


def test_patch_positions_match_transformers():
    from transformers.vision_utils import get_vision_position_ids

    grids = [(1, 4, 6), (2, 6, 2)]
    rows, cols = patch_rows_cols(grids, 2)
    want = get_vision_position_ids(torch.tensor(grids), 2)
    torch.testing.assert_close(torch.stack([rows, cols], dim=-1), want)


def test_incomplete_or_foreign_checkpoint_is_refused(reference, tp1):
    config, hf = reference
    state = hf.state_dict()
    tower = Glm5NextVisionTower(vision_arch(config))
    with pytest.raises(CheckpointError, match="lacks 1 vision tensors: model.visual.merger.proj.weight"):
        tower.load_weights((n, t) for n, t in state.items() if n != "merger.proj.weight")
    with pytest.raises(CheckpointError, match="unexpected vision tensor model.visual.blocks.9.norm1.weight"):
        tower.load_weights([*state.items(), ("blocks.9.norm1.weight", state["blocks.0.norm1.weight"])])


def test_out_hidden_size_must_match_text_hidden():
    config = reference_config()
    config.vision_config.out_hidden_size = 32
    with pytest.raises(CheckpointError, match="out_hidden_size"):
        vision_arch(config)


# ---------------------------------------------------------------------------------------------------------
# tensor parallel: heads and MLP widths split over 2 ranks (one process each, gloo)
# ---------------------------------------------------------------------------------------------------------


def _tp_rank(rank: int, init_method: str, state_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    config = reference_config()
    state = torch.load(state_path)
    with testing.standalone_model_parallel(tp_size=2, rank=rank, init_method=init_method):
        tower, _ = build_tower(config, state)
        with torch.no_grad():
            out = tower(pixels_for(GRIDS, tower.arch.patch_dim), GRIDS)
    if rank == 0:
        torch.save(out, out_path)


def test_tensor_parallel_2_matches_transformers(reference):
    config, hf = reference
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        state_path, out_path = os.path.join(d, "state.pt"), os.path.join(d, "out.pt")
        torch.save(hf.state_dict(), state_path)
        init = f"tcp://127.0.0.1:{testing.free_local_port()}"
        procs = [ctx.Process(target=_tp_rank, args=(r, init, state_path, out_path)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        got = torch.load(out_path)
    want = reference_output(hf, pixels_for(GRIDS, vision_arch(config).patch_dim), GRIDS)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
