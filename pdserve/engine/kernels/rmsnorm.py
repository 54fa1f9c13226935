"""RMSNorm (Zhang & Sennrich 2019) with the fused residual add, in one pass over each row.

Matches :class:`~pdserve.engine.layers.norm.RMSNorm`'s numerics: the residual sum is rounded
to the input dtype (it is the next residual stream), normalized in fp32, rounded to the input
dtype, then multiplied by the weight and rounded again. Unfused that is four or five passes
over the activations; fused, one read of ``x`` and ``residual`` and two writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels import next_power_of_2


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, eps,
                    stride_x, stride_r, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * hidden + cols, x, mask=ok)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused ``RMSNorm(x + residual)`` (Triton).

    Args:
        x: ``[num_tokens, hidden]`` bf16/fp16/fp32, rows contiguous.
        weight: ``[hidden]``, same dtype as ``x``.
        eps: added to the mean square.
        residual: ``[num_tokens, hidden]`` like ``x``, or None.

    Returns:
        The normalized ``[num_tokens, hidden]``, or ``(normalized, x + residual)``.
    """
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=torch.result_type(x, weight), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else out
    if num_tokens:
        _rmsnorm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, res_out, hidden, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0,
            HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(hidden))
    return out if residual is None else (out, res_out)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rms_norm` (the engine's ``RMSNorm.forward`` arithmetic)."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    out = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, residual)
