"""GPU kernels (NVIDIA CUDA, AMD ROCm) with the CPU backend's functions and signatures: ``kda`` (fla-core's
Triton KDA), ``indexer`` and ``sparse_mla`` (this package's Triton kernels; FlashMLA sparse where vLLM has it).

Requires ``triton`` and, for ``kda``, ``fla-core`` (``pip install vllm-glm53[cuda]``). Every kernel here also
runs on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the test suite checks them
against the CPU backend without a GPU (``make setup-triton``; tests/test_gpu_backends_kernels.py).

Sparse-MLA kernels vLLM 0.32 ships that accept this model's selection (NoPE, head size 512 = latent 512 +
RoPE 0, index rows of token positions padded with -1): FlashMLA's sparse prefill kernel (SM90 and SM100; bf16;
query heads padded to a multiple of 64, index rows to a multiple of 128) — used by ``sparse_mla`` when
present; FlashInfer's sparse MLA (TRTLLM-GEN on SM100, an SM90 plan, an SM120 variant) — not used: its entry
points take vLLM's paged-cache metadata rather than a gathered latent, so the Triton kernel serves there.
vLLM also vendors a copy of fla's KDA kernels (``vllm.third_party.flash_linear_attention``); this package
uses fla-core itself, whose API (slot-indexed in-place states, speculative slots) it is tested against.

KV-cache precision by GPU generation (the latent cache is what sparse MLA reads):
  * Hopper (H100/H200, SM90): BF16 KV cache only. vLLM's FP8 sparse-MLA plans on SM90 reject this model's
    FP8 view, and FlashMLA's packed FP8 layout assumes a 64-wide RoPE part that GLM-5.3 (NoPE) lacks; the
    plugin's latent cache refuses FP8 cache dtypes.
  * Blackwell (B200/GB200, SM100): FP8 KV is the intended serving format upstream (FlashInfer's TRTLLM-GEN
    sparse MLA reads NoPE 512 rows in FP8); the plugin's Triton kernels read BF16/FP16/FP32 latents.
"""
