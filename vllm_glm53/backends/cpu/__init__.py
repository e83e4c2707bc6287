"""Plain-PyTorch kernels: ``kda`` (short conv, gates, chunked/recurrent delta rule), ``indexer`` (k-pool
lightning indexer) and ``sparse_mla`` (absorbed NoPE latent attention over selected tokens).

Every function works on one sequence unless its docstring says "batch"; recurrent and coefficient maths run in
float32 and results come back in the activation dtype (architecture.md sections 5-7).
"""
