"""``vllm serve`` on the released (nested) layout with everything on: the vision tower for images and videos,
and MTP speculative decoding. One server for the module."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import requests

from conftest import hf_greedy, hf_model, prompt_set
from test_serve import NAME, _metric

pytestmark = [pytest.mark.serve, pytest.mark.engine]


def _png(seed: int, size=(56, 84)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _mp4(path, frames=4, size=(56, 56)) -> bytes:
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 2.0, size)
    rng = np.random.default_rng(7)
    for _ in range(frames):
        writer.write(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    writer.release()
    return path.read_bytes()


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    from conftest import served

    media = tmp_path_factory.mktemp("media")
    with served(tiny_ckpt("default"), (
        "--max-model-len", "1024",
        "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
        "--allowed-local-media-path", str(media),
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}', "--no-enable-prefix-caching",
    )) as server:
        yield {**server, "media": media}


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)


def _image_chat(client, url: str, **kwargs):
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                          max_tokens=6, temperature=0, logprobs=True,
                                          extra_body={"return_token_ids": True}, **kwargs)


def test_mtp_over_http_keeps_greedy_outputs_and_reports_acceptance(server, client):
    prompts = prompt_set(server["path"], [7, 60, 140])
    want = hf_greedy(hf_model(server["path"]), prompts, 12)
    names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total")
    before = requests.get(server["url"] + "/metrics", timeout=10).text
    generated = 0
    for prompt, w in zip(prompts, want):
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"return_token_ids": True})
        # The checkpoint's stop tokens end generation early in both stacks.
        assert out.choices[0].token_ids == w["token_ids"]
        generated += len(out.choices[0].token_ids)
    after = requests.get(server["url"] + "/metrics", timeout=10).text
    rounds, drafted, accepted = (_metric(after, n) - _metric(before, n) for n in names)
    # Each verification round drafts 2 tokens and yields its accepted drafts plus one token; each request's
    # first token comes from its prefill. A round can end a request early (a stop token, max_tokens), so the
    # tokens kept lie between one per round and one plus the accepted drafts per round.
    assert rounds > 0 and drafted == 2 * rounds and 0 <= accepted <= drafted
    assert len(prompts) + rounds <= generated <= len(prompts) + rounds + accepted


def test_image_by_data_url_and_by_local_file_are_the_same_request(server, client):
    png = _png(1)
    (server["media"] / "one.png").write_bytes(png)
    by_data = _image_chat(client, _data_url("image/png", png))
    by_file = _image_chat(client, f"file://{server['media'] / 'one.png'}")
    assert by_data.prompt_token_ids == by_file.prompt_token_ids
    assert by_data.choices[0].message.reasoning == by_file.choices[0].message.reasoning
    # The image reaches the model: another picture changes the first token's distribution.
    other = _image_chat(client, _data_url("image/png", _png(2)))
    first = [c.logprobs.content[0].logprob for c in (by_data.choices[0], other.choices[0])]
    assert by_data.prompt_token_ids == other.prompt_token_ids  # same size, so the same placeholders
    assert abs(first[0] - first[1]) > 1e-4 or by_data.choices[0].logprobs.content[0].token != \
        other.choices[0].logprobs.content[0].token


def test_repeated_image_hits_the_multimodal_cache(server, client):
    png = _png(3)
    url = _data_url("image/png", png)
    before = requests.get(server["url"] + "/metrics", timeout=10).text
    for _ in range(3):
        _image_chat(client, url)
    after = requests.get(server["url"] + "/metrics", timeout=10).text
    queries = _metric(after, "vllm:mm_cache_queries_total") - _metric(before, "vllm:mm_cache_queries_total")
    hits = _metric(after, "vllm:mm_cache_hits_total") - _metric(before, "vllm:mm_cache_hits_total")
    assert queries == 3 and hits == 2  # processed once, then reused: the cache does not grow per request


def test_video_url_with_a_generated_clip(server, client, tmp_path):
    from transformers import AutoTokenizer

    clip = _mp4(tmp_path / "clip.mp4")
    content = [{"type": "video_url", "video_url": {"url": _data_url("video/mp4", clip)}},
               {"type": "text", "text": "What happens?"}]
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                         max_tokens=4, temperature=0, extra_body={"return_token_ids": True})
    tok = AutoTokenizer.from_pretrained(str(server["path"]))
    ids = out.prompt_token_ids
    start, image = tok.convert_tokens_to_ids("<|begin_of_video|>"), tok.convert_tokens_to_ids("<|image|>")
    assert ids.count(start) == 1 and ids.count(image) > 0  # frames expanded into image placeholders
    assert "seconds" in tok.decode(ids)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_more_images_than_the_limit_is_a_400(server, client):
    image = {"type": "image_url", "image_url": {"url": _data_url("image/png", _png(4))}}
    body = {"model": NAME, "max_tokens": 2,
            "messages": [{"role": "user", "content": [image, image, image, {"type": "text", "text": "?"}]}]}
    r = requests.post(server["url"] + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text[:300]
    assert "image" in r.json()["error"]["message"]
    out = client.completions.create(model=NAME, prompt="still serving", max_tokens=2, temperature=0)
    assert out.choices[0].text is not None
