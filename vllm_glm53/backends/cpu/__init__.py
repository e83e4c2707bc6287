"""CPU ops: ``kda`` (short conv, gates, chunked/recurrent delta rule), ``indexer`` (k-pool lightning indexer),
``sparse_mla`` (absorbed NoPE latent attention over selected tokens), ``mhc`` (hyper-connection coefficients and
mixes) and ``moe`` (routed experts with the clamped SwiGLU).

Each op runs as a compiled kernel from csrc/ when those are built for this torch and CPU (``kernels``, built by
``python -m vllm_glm53.backends.cpu.build``), else as plain PyTorch; the plain forms stay available under
``*_torch`` names and are the reference the kernels are tested against (tests/test_cpu_kernels.py).

Every function works on one sequence unless its docstring says "batch"; the batch forms read vLLM's state pools
by slot and its paged cache by block table in place (``paged``). Recurrent and coefficient maths run in float32
and results come back in the activation dtype (architecture.md sections 3-8).
"""
