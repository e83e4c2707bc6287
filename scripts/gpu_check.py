#!/usr/bin/env python3
"""GPU check of the CUDA backends (vllm_glm53/backends/cuda) against the CPU backend, as one short run.

    python scripts/gpu_check.py [--out DIR] [--skip-e2e] [--checkpoint DIR] [--expected FILE.json]
    python scripts/gpu_check.py --make-expected DIR      # on the CPU machine (.venv): reference tokens

Stages (each prints PASS / FAIL / SKIP lines; the exit code is 1 if anything failed):
  1. kernels: tests/test_gpu_backends_kernels.py on the GPU (the tiny-shape comparisons the CPU suite runs
     under Triton's interpreter, plus the bf16 ones).
  2. real shapes: each op at the real per-layer geometry (64 KDA heads x 128, 64 MLA heads, latent 512,
     32 indexer heads x 128, index_topk 2048, kpool 4, a 32K context) against the CPU backend's torch ops run
     on the same GPU in float32: KDA prefill from a state, decode on a slot pool, speculative decode; indexer
     pooling, scores and selections (as sets, near-ties allowed); sparse MLA prefill and decode in float32 and
     bf16, through the Triton kernel and through FlashMLA where vLLM provides it.
  3. end to end (needs vLLM with CUDA, and transformers with glm5_next to build the checkpoint unless
     --checkpoint is given): the kernel-friendly tiny checkpoint (real head sizes) generated greedily through
     vLLM on this GPU with the CUDA backends and with the CPU backends' ops (VLLM_GLM53_BACKEND=cpu); the
     tokens must agree, and agree with --expected (made by --make-expected on a CPU machine) when given.
  4. vLLM's own model (issue #15; needs vLLM with CUDA): on the same checkpoint, vLLM's GLM5Next (what serves on a
     GPU by default) vs the plugin's model forced with VLLM_GLM53_MODEL=plugin, greedy tokens and logprobs in a
     table; then `vllm serve` with the plugin's tokenizer mode and parsers in front of vLLM's model, one chat.
Without a CUDA device the script prints why and exits 0.

On the H200 lent to this project (no network, torch and Triton preinstalled, no fla-core, no vLLM): carry
fla-core as a wheel. In the repo root on the CPU machine:
    echo /.whl/ >> .git/info/exclude && python3 -m pip download --no-deps -d .whl fla-core==0.6.0
then run there (carry: [".whl"], timeout_s about 540):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

RESULTS: list[dict] = []

# Prompt lengths: below index_topk (dense selection), and well above it (sparse), decoded past a pool boundary.
E2E_PROMPT_LENGTHS = (23, 150, 400)
E2E_MAX_TOKENS = 24


def record(stage: str, name: str, status: str, detail: str = "") -> None:
    RESULTS.append({"stage": stage, "name": name, "status": status, "detail": detail})
    print(f"[{status:4}] {stage:10} {name:48} {detail}", flush=True)


def check(stage: str, name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        detail = fn() or ""
    except AssertionError as exc:
        record(stage, name, "FAIL", str(exc)[:400])
    except Exception as exc:  # a crash in one check must not hide the others
        record(stage, name, "FAIL", f"{type(exc).__name__}: {str(exc)[:400]}")
    else:
        record(stage, name, "PASS", f"{detail} ({time.perf_counter() - t0:.1f}s)")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def assert_close(got, want, tol: float, what: str) -> str:
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative max error {err:.3g} > {tol}"
    return f"{what} err {err:.2g}"


# ---------------------------------------------------------------------------------------------------------------
# Stage 1: the tiny-shape kernel tests on the GPU
# ---------------------------------------------------------------------------------------------------------------


def stage_kernel_tests() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_gpu_backends_kernels.py", "-q", "-p", "no:cacheprovider",
         "-rfEs"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    record("kernels", "tests/test_gpu_backends_kernels.py", "PASS" if proc.returncode == 0 else "FAIL", tail)
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n")


# ---------------------------------------------------------------------------------------------------------------
# Stage 2: real per-layer shapes against the CPU backend's torch ops on the same device
# ---------------------------------------------------------------------------------------------------------------


def stage_real_shapes(device: torch.device, small: bool) -> None:
    from vllm_glm53.backends.cpu import indexer as ix_ref
    from vllm_glm53.backends.cpu import kda as kda_ref
    from vllm_glm53.backends.cpu import sparse_mla as mla_ref
    from vllm_glm53.backends.plans import LatentCachePlan, StateSlots

    # Real: 64 KDA heads x 128, 64 MLA heads, latent 512, indexer 32 x 128, topk 2048, kp 4, context 32K.
    # small (rehearsal under the interpreter): the same code at shapes a CPU can interpret.
    Hk, dk = (2, 16) if small else (64, 128)
    Hm, L = (4, 32) if small else (64, 512)
    nI, dI = (4, 16) if small else (32, 128)
    topk, kp = (16, 4) if small else (2048, 4)
    ctx = 300 if small else 32768
    act_dtype = torch.float32 if small else torch.bfloat16  # numpy, under the interpreter, has no bfloat16
    T_prefill = 80 if small else 4096
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    try:
        from vllm_glm53.backends.cuda import kda as kda_gpu
    except ImportError as exc:
        record("real", "KDA (fla-core)", "SKIP", f"fla-core not importable: {exc}")
        kda_gpu = None
    from vllm_glm53.backends.cuda import indexer as ix_gpu
    from vllm_glm53.backends.cuda import sparse_mla as mla_gpu

    # fla's float32 GEMMs may run in TF32 on the GPU: tolerances sized for that over 4K-token recurrences.
    kda_tol = 1e-4 if small else 2e-2

    if kda_gpu is not None:
        def kda_inputs(T):
            q, k = kda_ref.l2norm_qk(rnd(T, Hk, dk), rnd(T, Hk, dk), dk)
            decay = kda_ref.kda_gate(rnd(T, Hk, dk, scale=3.0), rnd(Hk), -5.0)
            return q, k, rnd(T, Hk, dk), decay, torch.rand(T, Hk, generator=g).to(device)

        def kda_prefill():
            q, k, v, decay, beta = kda_inputs(T_prefill)
            s0 = rnd(Hk, dk, dk, scale=0.1)
            o_ref, s_ref = kda_ref.kda_chunked(q, k, v, decay, beta, s0)
            o, s = kda_gpu.kda_chunked(q, k, v, decay, beta, s0)
            return ", ".join([assert_close(o, o_ref, kda_tol, "out"), assert_close(s, s_ref, kda_tol, "state")])

        def kda_conv():
            C = 3 * Hk * dk
            x, w, st = rnd(T_prefill, C, scale=0.5), rnd(C, 4, scale=0.5), rnd(C, 3)
            x, st = x.to(act_dtype), st.to(act_dtype)
            y_ref, s_ref = kda_ref.causal_conv1d(x, w, st)
            y, s = kda_gpu.causal_conv1d(x, w, st)
            return ", ".join([assert_close(y, y_ref, 2e-2, "out"), assert_close(s, s_ref, 0.0, "state")])

        def kda_decode_pool():
            B = 64
            q, k, v, decay, beta = kda_inputs(B)
            pool = rnd(2 * B, Hk, dk, dk, scale=0.1)
            slots = torch.randperm(2 * B, generator=g)[:B].to(device)
            plan = StateSlots.single_slot(torch.arange(B + 1, device=device), slots,
                                          torch.ones(B, dtype=torch.bool, device=device), B, 1)
            want = pool.clone()
            o_ref = kda_ref.kda_varlen.implementation("torch")(q, k, v, decay, beta, want, plan)
            o = kda_gpu.kda_varlen.implementation("fla_recurrent")(q, k, v, decay, beta, pool, plan)
            return ", ".join([assert_close(o, o_ref, kda_tol, "out"), assert_close(pool, want, kda_tol, "pool")])

        def kda_spec_decode():
            R, S = 16, 3  # requests, tokens per request (1 + 2 drafts)
            q, k, v, decay, beta = kda_inputs(R * S)
            pool = rnd(R * S + 4, Hk, dk, dk, scale=0.1)
            slots = torch.randperm(R * S + 4, generator=g)[: R * S].view(R, S).to(device)
            accepted = torch.randint(1, S + 1, (R,), generator=g).to(device)
            plan = StateSlots.speculative(torch.arange(0, R * S + 1, S, device=device), slots, accepted, R * S, S)
            want = pool.clone()
            o_ref = kda_ref.kda_varlen.implementation("torch")(q, k, v, decay, beta, want, plan)
            o = kda_gpu.kda_varlen.implementation("fla_speculative")(q, k, v, decay, beta, pool, plan)
            return ", ".join([assert_close(o, o_ref, kda_tol, "out"), assert_close(pool, want, kda_tol, "pool")])

        check("real", f"KDA chunked prefill T={T_prefill} H={Hk} d={dk}", kda_prefill)
        check("real", f"KDA short conv {act_dtype}", kda_conv)
        check("real", "KDA decode on a slot pool B=64", kda_decode_pool)
        check("real", "KDA speculative decode 16 x (1+2)", kda_spec_decode)

    # --- indexer ---
    rows = torch.cat([rnd(ctx, L), rnd(ctx, dI), rnd(ctx, dI, scale=2.0)], dim=1)
    ape = rnd(kp, dI, scale=0.5)
    n_pools = ctx // kp

    def selection(ix, q, w, positions):
        pooled = ix.kpool_compress(rows[: n_pools * kp, L : L + dI], rows[: n_pools * kp, L + dI :], ape)
        scores = ix.index_scores(q, w, pooled)
        return ix.select_tokens(scores, positions, topk, kp), scores

    def same_selection(got, want, scores):
        """Sets per row; differing pools must be near-ties in the reference scores."""
        mismatched = 0
        for r in range(got.shape[0]):
            gs, ws = set(got[r][got[r] >= 0].tolist()), set(want[r][want[r] >= 0].tolist())
            if gs == ws:
                continue
            mismatched += 1
            only = sorted({t // kp for t in gs ^ ws})
            band = scores[r, only]
            tol = 1e-3 * max(1.0, scores[r].abs().max().item())
            assert (band.max() - band.min()).item() <= tol, f"row {r}: pools {only} differ and are no tie"
        return f"{got.shape[0]} rows, {mismatched} differ only in near-ties"

    def indexer_pool_scores():
        pooled_ref = ix_ref.kpool_compress(rows[:, L : L + dI], rows[:, L + dI :], ape)
        pooled = ix_gpu.kpool_compress(rows[:, L : L + dI], rows[:, L + dI :], ape)
        q, w = rnd(64, nI, dI), rnd(64, nI)
        s_ref, s = ix_ref.index_scores(q, w, pooled_ref), ix_gpu.index_scores(q, w, pooled_ref)
        return ", ".join([assert_close(pooled, pooled_ref, 1e-5, "pooled"), assert_close(s, s_ref, 1e-4, "scores")])

    def indexer_select(Tq, dtype):
        def run():
            positions = torch.arange(ctx - Tq, ctx, device=device)
            q, w = rnd(Tq, nI, dI), rnd(Tq, nI)
            want, scores = selection(ix_ref, q, w, positions)
            got, _ = selection(ix_gpu, q.to(dtype), w, positions)
            if dtype == torch.float32:
                return same_selection(got, want, scores)
            overlap = [len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist())) / max(1, (b >= 0).sum().item())
                       for a, b in zip(got.cpu(), want.cpu())]
            assert min(overlap) > 0.9, f"bf16 selection overlap {min(overlap):.3f}"
            return f"bf16 selection overlap >= {min(overlap):.3f}"
        return run

    check("real", f"indexer pooling + scores ctx={ctx}", indexer_pool_scores)
    check("real", f"indexer selection decode x8 ctx={ctx} fp32", indexer_select(8, torch.float32))
    check("real", f"indexer selection prefill x256 ctx={ctx} fp32", indexer_select(256, torch.float32))
    if not small:
        check("real", f"indexer selection decode x8 ctx={ctx} bf16", indexer_select(8, torch.bfloat16))

    # --- sparse MLA ---
    width = ix_ref.index_width(topk, kp)

    def mla(Tq, dtype, force_triton):
        def run():
            positions = torch.arange(ctx - Tq, ctx, device=device)
            q_idx, w_idx = rnd(Tq, nI, dI), rnd(Tq, nI)
            indices, _ = selection(ix_ref, q_idx, w_idx, positions)
            q_lat = rnd(Tq, Hm, L, scale=0.05)
            latent = rows[:, :L]
            want = mla_ref.sparse_latent_attention(q_lat, latent, indices, 256**-0.5)
            if force_triton:
                os.environ["VLLM_GLM53_SPARSE_MLA"] = "triton"
            try:
                got = mla_gpu.sparse_latent_attention(q_lat.to(dtype), latent.to(dtype), indices, 256**-0.5)
            finally:
                os.environ.pop("VLLM_GLM53_SPARSE_MLA", None)
            return assert_close(got, want, 1e-4 if dtype == torch.float32 else 2e-2, f"N={width}")
        return run

    flashmla = None
    if device.type == "cuda":
        from vllm_glm53 import _vllm

        try:
            flashmla = _vllm.flashmla_sparse_fwd()
        except ImportError:
            flashmla = None
    for Tq, kind in ((256, "prefill"), (4, "decode")):
        check("real", f"sparse MLA {kind} x{Tq} H={Hm} L={L} fp32 triton", mla(Tq, torch.float32, True))
        if not small:
            check("real", f"sparse MLA {kind} x{Tq} bf16 triton", mla(Tq, torch.bfloat16, True))
            if flashmla is not None and L == 512:
                check("real", f"sparse MLA {kind} x{Tq} bf16 FlashMLA", mla(Tq, torch.bfloat16, False))
    def mla_paged():
        """A decode batch of 8 requests over the paged cache (pages of 64 rows in shuffled order), one launch."""
        bs, R = (4 if small else 64), 8
        n_blocks = ctx // bs
        pages = rows.view(n_blocks, bs, rows.shape[1])
        table = torch.stack([torch.randperm(n_blocks, generator=g) for _ in range(R)]).to(device)
        q_idx, w_idx = rnd(R, nI, dI), rnd(R, nI)
        positions = torch.full((1,), ctx - 1, device=device)
        blocks = []
        for r in range(R):
            seq = pages[table[r]].reshape(ctx, rows.shape[1])
            pooled = ix_ref.kpool_compress(seq[:, L : L + dI], seq[:, L + dI :], ape)
            scores = ix_ref.index_scores(q_idx[r : r + 1], w_idx[r : r + 1], pooled)
            blocks.append(ix_ref.select_tokens(scores, positions, topk, kp))
        indices = torch.cat(blocks)
        q_lat = rnd(R, Hm, L, scale=0.05)
        lens = torch.full((R,), ctx, device=device)
        plan = LatentCachePlan(torch.arange(R + 1, device=device), lens, lens - 1, table,
                               torch.zeros(R, dtype=torch.int64, device=device), R, R, 1, ctx)
        want = mla_ref.sparse_latent_attention_paged(q_lat, pages, plan, indices, 256**-0.5, L)
        got = mla_gpu.sparse_latent_attention_paged(q_lat, pages, plan, indices, 256**-0.5, L)
        return assert_close(got, want, 1e-4, f"{R} requests")

    check("real", f"sparse MLA paged decode batch ctx={ctx} fp32", mla_paged)
    if flashmla is None and not small:
        record("real", "sparse MLA via FlashMLA", "SKIP", "vLLM's FlashMLA sparse kernel is not available here")


# ---------------------------------------------------------------------------------------------------------------
# Stage 3: end to end through vLLM
# ---------------------------------------------------------------------------------------------------------------


def build_checkpoint(out: Path) -> None:
    subprocess.run([sys.executable, "-m", "vllm_glm53.tiny", str(out), "--kernel-friendly"],
                   cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)


def e2e_prompts(checkpoint: Path) -> list[list[int]]:
    """Deterministic prompts of ordinary (non-special) token ids of the checkpoint's own vocabulary."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(10, min(vocab, 470), (n,), generator=gen).tolist() for n in E2E_PROMPT_LENGTHS]


def generate(checkpoint: Path, backend: str, engine: dict, model: str = "plugin") -> list[dict]:
    """Greedy outputs of ``model`` (VLLM_GLM53_MODEL: ``plugin`` with the given op ``backend``, or ``vllm``)."""
    spec = {"model": str(checkpoint), "prompts": e2e_prompts(checkpoint),
            "max_tokens": [E2E_MAX_TOKENS] * len(E2E_PROMPT_LENGTHS), "ignore_eos": True, "logprobs": 1,
            "engine": engine}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_GLM53_BACKEND": backend, "VLLM_GLM53_MODEL": model, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([sys.executable, "tests/engine_runner.py", str(spec_path), str(out_path)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
        if proc.returncode != 0:
            raise RuntimeError(f"engine run ({backend}) failed:\n{proc.stderr[-3000:]}")
        return json.loads(out_path.read_text())


def compare_tokens(got: list[dict], want: list[dict], what: str) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a["token_ids"] != b["token_ids"]:
            n = next(j for j, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y)
            raise AssertionError(f"{what}: prompt {i} ({E2E_PROMPT_LENGTHS[i]} tokens) diverges at step {n}: "
                                 f"{a['token_ids'][n]} vs {b['token_ids'][n]} (logprobs {a['logprobs'][n]:.4f} / "
                                 f"{b['logprobs'][n]:.4f})")
    return f"{what}: {len(got)} prompts x {E2E_MAX_TOKENS} tokens identical"


def stage_e2e(args) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        record("e2e", "greedy parity through vLLM", "SKIP", "vLLM is not installed in this environment")
        return
    work = Path(tempfile.mkdtemp(prefix="glm53-gpu-check-"))
    checkpoint = Path(args.checkpoint) if args.checkpoint else work / "ckpt"
    if not args.checkpoint:
        try:
            build_checkpoint(checkpoint)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            record("e2e", "build the kernel-friendly checkpoint", "SKIP",
                   f"needs transformers with glm5_next (or pass --checkpoint): {getattr(exc, 'stderr', '')[-300:]}")
            return
    engine = {"dtype": "float32", "max_model_len": 1024, "gpu_memory_utilization": 0.3}
    runs: dict[str, list[dict]] = {}

    def run(backend):
        def go():
            runs[backend] = generate(checkpoint, backend, engine)
            return f"{len(runs[backend])} prompts"
        return go

    check("e2e", "vLLM + CUDA backends (greedy, fp32)", run("cuda"))
    check("e2e", "vLLM + CPU backends' ops on the GPU", run("cpu"))
    if "cuda" in runs and "cpu" in runs:
        check("e2e", "tokens: CUDA backends == CPU ops", lambda: compare_tokens(runs["cuda"], runs["cpu"], "cuda/cpu"))
    if args.expected and "cuda" in runs:
        want = json.loads(Path(args.expected).read_text())["outputs"]
        check("e2e", "tokens: GPU == vLLM on CPU", lambda: compare_tokens(runs["cuda"], want, "gpu/cpu-engine"))
    stage_vllm_model(checkpoint, runs.get("cuda"))


def stage_vllm_model(checkpoint: Path, plugin_runs: list[dict] | None) -> None:
    """Issue #15: on a GPU vLLM's own GLM5Next serves (VLLM_GLM53_MODEL=auto); the plugin only completes it.
    Greedy tokens and logprobs of vLLM's model vs the plugin's (forced) on one checkpoint, as a table; then
    ``vllm serve`` with the plugin's tokenizer mode and parsers in front of vLLM's model, one chat request."""
    engine = {"dtype": "bfloat16", "max_model_len": 1024, "gpu_memory_utilization": 0.3}
    runs: dict[str, list[dict]] = {}

    def run(model):
        def go():
            runs[model] = generate(checkpoint, "cuda", engine, model=model)
            return f"{len(runs[model])} prompts"
        return go

    check("vllm-model", "vLLM's own GLM5Next (bf16)", run("vllm"))
    check("vllm-model", "the plugin's model (bf16, forced)", run("plugin"))
    if len(runs) == 2:
        print(f"{'prompt':>8} {'tokens equal':>13} {'first diff':>10} {'max |dlogprob| before it':>26}")
        for n, a, b in zip(E2E_PROMPT_LENGTHS, runs["vllm"], runs["plugin"]):
            same = [x == y for x, y in zip(a["token_ids"], b["token_ids"])]
            first = same.index(False) if not all(same) else len(same)
            gap = max((abs(x - y) for x, y in zip(a["logprobs"][:first], b["logprobs"][:first])), default=0.0)
            print(f"{n:>8} {sum(same):>6}/{len(same):<6} {first:>10} {gap:>26.4f}")
        # bf16 on different kernels: a greedy flip on a near-tie is possible; report, and fail on an early one
        check("vllm-model", "vLLM's model vs the plugin's: first 8 tokens equal",
              lambda: compare_tokens([dict(r, token_ids=r["token_ids"][:8]) for r in runs["vllm"]],
                                     [dict(r, token_ids=r["token_ids"][:8]) for r in runs["plugin"]], "vllm/plugin"))
    check("vllm-model", "vllm serve: glm5_next tokenizer mode + parsers over vLLM's model",
          lambda: serve_chat(checkpoint))


def serve_chat(checkpoint: Path) -> str:
    """Start ``vllm serve`` (vLLM's own model, the plugin's front-end), send one chat request with a tool and
    reasoning_effort, and check the response parses; stops the server."""
    import urllib.request

    from vllm_glm53.demo import Server, free_port

    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(checkpoint), "--port", str(port),
            "--tokenizer-mode", "glm5_next", "--tool-call-parser", "glm47", "--reasoning-parser", "glm47",
            "--enable-auto-tool-choice", "--max-model-len", "1024", "--gpu-memory-utilization", "0.3"]
    server = Server(argv, {"VLLM_GLM53_MODEL": "auto", "HF_HUB_OFFLINE": "1"}, echo=False)
    try:
        deadline = time.time() + 400
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        else:
            raise RuntimeError("server did not become healthy:\n" + "\n".join(server.lines[-40:]))
        served = [l for l in server.lines if "GLM-5.3 is served by" in l]
        if not served or "vLLM's own GLM5Next" not in served[0]:
            raise AssertionError(f"expected vLLM's own model to serve: {served}")
        body = {"model": str(checkpoint), "max_tokens": 16, "reasoning_effort": "high",
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                    "type": "object", "properties": {"city": {"type": "string"}}}}}]}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
        return f"finish_reason {reply['choices'][0]['finish_reason']}, served by vLLM's model"
    finally:
        server.stop()


def make_expected(out_dir: Path) -> int:
    """On the CPU machine: build the kernel-friendly checkpoint and record vLLM-on-CPU greedy outputs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = out_dir / "ckpt"
    build_checkpoint(checkpoint)
    outputs = generate(checkpoint, "cpu", {"dtype": "float32", "max_model_len": 1024})
    (out_dir / "expected.json").write_text(json.dumps({"checkpoint": str(checkpoint), "outputs": outputs}))
    print(f"wrote {out_dir / 'expected.json'} and the checkpoint {checkpoint}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="directory for gpu_check.json")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--checkpoint", help="kernel-friendly tiny checkpoint to use instead of building one")
    parser.add_argument("--expected", help="expected.json from --make-expected (vLLM on CPU)")
    parser.add_argument("--make-expected", metavar="DIR", help="CPU machine: build the checkpoint, record outputs")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="run stage 2 at small shapes on the CPU under TRITON_INTERPRET=1 (checks this script)")
    parser.add_argument("--full-autotune", action="store_true",
                        help="autotune every kernel fully (default: first config only, to save compile time)")
    args = parser.parse_args()
    if args.make_expected:
        return make_expected(Path(args.make_expected))

    if args.rehearse_on_cpu:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--rehearse-on-cpu needs TRITON_INTERPRET=1 (in .venv-triton)")
            return 2
        import tests.test_gpu_backends_kernels  # noqa: F401  (importing it applies the interpreter fixes)

        stage_real_shapes(torch.device("cpu"), small=True)
    elif not torch.cuda.is_available():
        print("SKIP: no CUDA device here; scripts/gpu_check.py checks the CUDA backends on a GPU.")
        return 0
    else:
        if not args.full_autotune:
            # Correctness does not depend on the kernel config: compile the first candidate only (the full
            # autotune of fla's KDA kernels compiles dozens of variants, minutes of a short device lease).
            os.environ["GLM53_ONE_AUTOTUNE_CONFIG"] = "1"
            import tests.test_gpu_backends_kernels as kernel_tests

            kernel_tests.one_autotune_config()
        print(f"device: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), "
              f"torch {torch.__version__}, triton {__import__('triton').__version__}", flush=True)
        stage_kernel_tests()
        stage_real_shapes(torch.device("cuda"), small=False)
        if not args.skip_e2e:
            stage_e2e(args)

    failed = [r for r in RESULTS if r["status"] == "FAIL"]
    counts = {s: sum(r["status"] == s for r in RESULTS) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
