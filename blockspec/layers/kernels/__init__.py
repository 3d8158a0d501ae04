"""Triton kernels for the CUDA path. Importing this package needs nothing; its modules need
triton, so callers import them lazily (see `blockspec.layers.attention.paged_attention`)."""
