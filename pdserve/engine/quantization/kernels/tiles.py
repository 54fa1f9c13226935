"""Tile helpers the quantized GEMM kernels share (Triton device functions)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is a declared dependency on Linux
    triton = None

if triton is not None:

    @triton.jit
    def load_x_tile(x_ptr, offs_m, offs_k, M, K, stride_xm):
        """``[BLOCK_M, BLOCK_K]`` activations (zeros outside ``M x K``)."""
        return tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                       mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)

    @triton.jit
    def store_y_tile(y_ptr, acc, offs_m, offs_n, M, N, stride_ym):
        """Write the fp32 accumulator ``[BLOCK_M, BLOCK_N]`` in ``y``'s dtype."""
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
