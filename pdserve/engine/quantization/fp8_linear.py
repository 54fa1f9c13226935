"""``Fp8Linear``: dynamic FP8 (e4m3) weights with one scale per output channel.

The weight is quantized at load: ``s[o] = max_i |W[o, i]| / 448`` and
``W8 = fp8_e4m3(W / s)``. Where the GPU computes FP8 GEMMs (compute capability >= 8.9)
activations are quantized per token the same way and the product runs in
``torch._scaled_mm`` with row-wise scales (FP8 W8A8). Elsewhere (CPU, older GPUs) it is
weight-only: a slab of rows is dequantized to ``W8 * s`` and multiplied in 16/32-bit.
"""

from __future__ import annotations

import torch

from pdserve.engine.quantization.base import DEFAULT_MAX_SCRATCH_ELEMS, QuantizedLinear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [rows, cols]`` -> (``[rows, cols]`` float8_e4m3fn, ``[rows]`` fp32 scales)."""
    w = weight.float()
    scales = (w.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def device_has_fp8_gemm(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 x FP8 on ``device`` (CUDA, capability >= 8.9)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(QuantizedLinear):
    """FP8 e4m3 weight ``[out, in]`` plus fp32 per-output-channel scales ``[out]``.

    Args:
        weight: ``[out, in]`` float, quantized here.
        bias: ``[out]`` or None.
        gemm_dtype: dtype of the weight-only GEMM.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemm_dtype: torch.dtype,
                 max_scratch_elems: int = DEFAULT_MAX_SCRATCH_ELEMS) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias, gemm_dtype, max_scratch_elems)
        w8, scales = quantize_fp8_rows(weight)
        self.register_buffer("weight_fp8", w8)
        self.register_buffer("weight_scale", scales)
        self.use_scaled_mm: bool | None = None  # decided on the first call, on its device

    def dequantize_rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """``W8[start:end] * s[start:end]``: ``[end - start, in_features]`` in ``dtype``."""
        w = self.weight_fp8[start:end].to(torch.float32) * self.weight_scale[start:end, None]
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features] -> [..., out_features]`` in ``x.dtype``.

        With FP8 GEMMs on ``x``'s device (checked on the first call): W8A8 through
        ``torch._scaled_mm`` with per-token activation scales, bf16 out; otherwise the
        weight-only slab path of :class:`~.base.QuantizedLinear`.
        """
        if self.use_scaled_mm is None:
            self.use_scaled_mm = device_has_fp8_gemm(x.device)
        if not self.use_scaled_mm:
            return super().forward(x)
        x2 = x.reshape(-1, self.in_features)
        x8, x_scale = quantize_fp8_rows(x2)  # per-token activation scales, [num_tokens]
        y = torch._scaled_mm(x8, self.weight_fp8.t(), scale_a=x_scale[:, None],
                             scale_b=self.weight_scale[None, :], out_dtype=torch.bfloat16)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)
