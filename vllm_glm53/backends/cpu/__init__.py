"""CPU ops: ``kda`` (short conv, gates, chunked/recurrent delta rule), ``indexer`` (k-pool lightning indexer),
``sparse_mla`` (absorbed NoPE latent attention over selected tokens), ``mhc`` (hyper-connection coefficients and
mixes) and ``moe`` (routed experts with the clamped SwiGLU).

Each op is an :class:`~vllm_glm53.backends.dispatch.Op` with a ``compiled`` implementation from csrc/ (used when the
kernels are built for this torch and CPU: ``kernels``, built by ``python -m vllm_glm53.backends.cpu.build``) and a
plain-PyTorch ``torch`` one, kept under a ``*_torch`` name: the reference the kernels are tested against
(tests/test_cpu_kernels.py), which runs on any device.

The batch-wide ops a layer calls once per step (``kda_varlen``, ``causal_conv1d_varlen``, ``store_pooled_keys``,
``select_batch``, ``sparse_latent_attention_paged``) take the step plan (:mod:`vllm_glm53.backends.plans`) and read
vLLM's state pools by slot and its paged cache by block table in place; the other functions work on one sequence
and are the per-sequence references and building blocks. Recurrent and coefficient maths run in float32 and
results come back in the activation dtype (architecture.md sections 3-8).
"""
