"""Attention and matmul kernels: each beside a pure-JAX reference with the same signature."""
