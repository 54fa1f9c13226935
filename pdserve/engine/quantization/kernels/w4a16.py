"""Fused W4A16 dequant-GEMM: ``y = x @ dequant(qweight)^T`` without materializing the weight.

Layout (:class:`~pdserve.engine.quantization.int_linear.IntLinear`)::

    qweight [N, K/2] uint8   byte k//2 of row n: column k in the low nibble if k is even
    scales  [N, G]   fp16    G = ceil(K / group_size)
    zeros   [N, G]   uint8 or fp16   w[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g], g = k // group

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y``, walking K in ``BLOCK_K``
steps: it loads the packed bytes of a ``[BLOCK_K, BLOCK_N]`` weight tile, unpacks the
nibbles in registers, applies each column's group scale and zero, and accumulates
``x_tile @ w_tile`` in fp32.
"""

from __future__ import annotations

import torch


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dequantize-then-matmul in fp32: ``x [M, K] -> [M, N]`` in ``x.dtype``."""
    codes = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(qweight.shape[0], -1)
    gi = torch.arange(codes.shape[1], device=codes.device) // group_size
    w = (codes.float() - zeros.float()[:, gi]) * scales.float()[:, gi]
    return (x.float() @ w.t()).to(x.dtype)


try:  # the package works without Triton (CPU); the kernel needs it
    import triton
    import triton.language as tl

    from pdserve.engine.quantization.kernels.tiles import load_x_tile, store_y_tile
except ImportError:  # pragma: no cover - Triton is a declared dependency on Linux
    triton = None


def is_available() -> bool:
    """Whether Triton is importable."""
    return triton is not None


if triton is not None:

    @triton.jit
    def w4a16_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, G, group_size,
                          stride_xm, stride_ym,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One ``[BLOCK_M, BLOCK_N]`` tile of ``y [M, N]`` (layout in the module docstring),
        K walked in ``BLOCK_K`` steps, fp32 accumulation, stored in ``y``'s dtype."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        half_k = (K + 1) // 2
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = load_x_tile(x_ptr, offs_m, offs_k, M, K, stride_xm)
            mask_w = (offs_k[:, None] < K) & (offs_n[None, :] < N)
            packed = tl.load(q_ptr + offs_n[None, :] * half_k + offs_k[:, None] // 2,
                             mask=mask_w, other=0)
            q = (packed.to(tl.int32) >> ((offs_k[:, None] % 2) * 4)) & 0xF
            g = offs_k[:, None] // group_size
            s = tl.load(s_ptr + offs_n[None, :] * G + g, mask=mask_w, other=0.0)
            z = tl.load(z_ptr + offs_n[None, :] * G + g, mask=mask_w, other=0)
            w = (q.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)  # [BLOCK_K, BLOCK_N]
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))
        store_y_tile(y_ptr, acc, offs_m, offs_n, M, N, stride_ym)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group_size: int, block_m: int = 16, block_n: int = 64,
                 block_k: int = 64) -> torch.Tensor:
    """``x [M, K]`` (fp16/bf16/fp32) -> ``[M, N]`` in ``x.dtype`` (fp32 accumulation).

    Raises:
        ValueError: shapes that do not fit the layout.
    """
    M, K = x.shape
    N = qweight.shape[0]
    if qweight.shape[1] * 2 != K or scales.shape != zeros.shape or scales.shape[0] != N:
        raise ValueError(f"w4a16: x {tuple(x.shape)} does not fit qweight "
                         f"{tuple(qweight.shape)} / scales {tuple(scales.shape)}")
    x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    w4a16_gemm_kernel[grid](x, qweight, scales, zeros, y, M, N, K, scales.shape[1], group_size,
                 x.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
