"""Fused GGUF dequant-GEMM/GEMV for Q4_0, Q4_1 and Q8_0 rows: the weight is never materialized.

Row ``n`` of the weight is ``K / 32`` blocks of ``BLOCK_BYTES`` bytes (see
:mod:`pdserve.engine.quantization.gguf_blocks`); column ``k`` lives in block ``b = k // 32``
at position ``j = k % 32``::

    Q8_0  d = f16[0:2]                 q = int8 byte[2 + j]                       w = d * q
    Q4_0  d = f16[0:2]                 q = nibble of byte[2 + j % 16] (hi if j>=16) w = d * (q - 8)
    Q4_1  d = f16[0:2], m = f16[2:4]   q = nibble of byte[4 + j % 16] (hi if j>=16) w = d * q + m

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y = x @ W^T`` (``BLOCK_M = 16``
covers decode's GEMV with masking), decoding the weight tile in registers.
"""

from __future__ import annotations

import gguf
import torch

from pdserve.engine.quantization.gguf_blocks import BLOCK_DEQUANTIZERS, dequantize_rows

T = gguf.GGMLQuantizationType

#: GGML type -> kernel format code (constexpr ``FMT``).
SUPPORTED_TYPES = {T.Q8_0: 0, T.Q4_0: 1, T.Q4_1: 2}

try:  # the package works without Triton (CPU); the kernel needs it
    import triton
    import triton.language as tl

    from pdserve.engine.quantization.kernels.tiles import load_x_tile, store_y_tile
except ImportError:  # pragma: no cover - Triton is a declared dependency on Linux
    triton = None


def is_available() -> bool:
    """Whether Triton is importable."""
    return triton is not None


def gguf_linear_reference(x: torch.Tensor, packed: torch.Tensor, ggml_type: T) -> torch.Tensor:
    """Dequantize-then-matmul in fp32: ``x [M, K]``, ``packed [N, row_bytes]`` -> ``[M, N]``."""
    return (x.float() @ dequantize_rows(ggml_type, packed).t()).to(x.dtype)


if triton is not None:

    @triton.jit
    def _f16_at(ptr, offs, mask):
        lo = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + offs + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def gguf_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
                         FMT: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One ``[BLOCK_M, BLOCK_N]`` tile of ``y [M, N] = x [M, K] @ W^T``, ``W`` as GGML rows
        ``[N, row_bytes]`` uint8 of format ``FMT`` (:data:`SUPPORTED_TYPES`); each weight
        tile is dequantized in registers, fp32 accumulation, stored in ``y``'s dtype."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = load_x_tile(x_ptr, offs_m, offs_k, M, K, stride_xm)
            mask_w = (offs_k[:, None] < K) & (offs_n[None, :] < N)
            # byte offset of each (k, n) element's block: [BLOCK_K, BLOCK_N]
            base = offs_n[None, :] * row_bytes + (offs_k[:, None] // 32) * BLOCK_BYTES
            j = offs_k[:, None] % 32
            d = _f16_at(w_ptr, base, mask_w)
            if FMT == 0:
                q = tl.load(w_ptr + base + 2 + j, mask=mask_w, other=0).to(tl.int8, bitcast=True)
                w = d * q.to(tl.float32)
            else:
                qs = 2 if FMT == 1 else 4
                byte = tl.load(w_ptr + base + qs + j % 16, mask=mask_w, other=0).to(tl.int32)
                q = ((byte >> ((j // 16) * 4)) & 0xF).to(tl.float32)
                if FMT == 1:
                    w = d * (q - 8.0)
                else:
                    w = d * q + _f16_at(w_ptr, base + 2, mask_w)
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))
        store_y_tile(y_ptr, acc, offs_m, offs_n, M, N, stride_ym)


def gguf_linear(x: torch.Tensor, packed: torch.Tensor, ggml_type: T, block_m: int = 16,
                block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """``x [M, K]`` times the GGML rows ``packed [N, row_bytes]`` (transposed): ``[M, N]``.

    Raises:
        ValueError: ``ggml_type`` not in :data:`SUPPORTED_TYPES`, or ``K`` does not match.
    """
    if ggml_type not in SUPPORTED_TYPES:
        raise ValueError(f"gguf_linear supports {[t.name for t in SUPPORTED_TYPES]}, "
                         f"got {ggml_type.name}")
    _, values, nbytes = BLOCK_DEQUANTIZERS[ggml_type]
    M, K = x.shape
    N, row_bytes = packed.shape
    if row_bytes // nbytes * values != K:
        raise ValueError(f"gguf_linear: x has K={K}, rows hold {row_bytes // nbytes * values}")
    x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    gguf_gemm_kernel[grid](x, packed, y, M, N, K, row_bytes, x.stride(0), y.stride(0),
                           FMT=SUPPORTED_TYPES[ggml_type], BLOCK_BYTES=nbytes, BLOCK_M=block_m,
                           BLOCK_N=block_n, BLOCK_K=block_k)
    return y
