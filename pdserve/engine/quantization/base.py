"""What every quantized linear layer shares: a packed weight, a dequantizer and a bounded GEMM.

A quantized layer keeps its weight packed (``uint8``/``int32`` codes plus scales) and, at
matmul time, dequantizes it a slab of output rows at a time into a scratch buffer of at most
``max_scratch_elems`` elements, then runs a dense GEMM on the slab::

    x [num_tokens, in]            packed W [out, in / pack]
          \\                        |  dequantize rows r0:r1 (scratch [r1 - r0, in])
           \\----------- GEMM -----/
                  y[:, r0:r1]

The GEMM runs in ``gemm_dtype``: the activation dtype where the device has native GEMMs for
it, fp32 on CPUs without native bf16/fp16 (the same arithmetic as ``Fp32GemmLinear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.quantization.cpu_packed import PACKED_ACTIVATION_DTYPES, packed_cpu_forward

#: Largest dequantized slab (elements) one layer materializes at a time: 8 Mi fp32 = 32 MiB.
DEFAULT_MAX_SCRATCH_ELEMS = 8 * 1024 * 1024


class QuantizedLinear(nn.Module):
    """Base class: ``y = x @ dequantize(W)^T + b`` with bounded dequantization scratch.

    Subclasses register their packed tensors as buffers and implement
    :meth:`dequantize_rows`. ``bias`` is kept in the model dtype.

    Args:
        in_features: columns of the logical weight.
        out_features: rows of the logical weight.
        bias: ``[out_features]`` or None.
        gemm_dtype: dtype of the dequantized slab and of the GEMM.
        max_scratch_elems: largest slab, in elements.
    """

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 gemm_dtype: torch.dtype,
                 max_scratch_elems: int = DEFAULT_MAX_SCRATCH_ELEMS) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.gemm_dtype = gemm_dtype
        self.max_rows_per_slab = max(1, max_scratch_elems // max(1, in_features))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def dequantize_rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``start:end`` of the logical weight, ``[end - start, in_features]`` in ``dtype``."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole logical weight ``[out_features, in_features]`` in ``dtype``."""
        return self.dequantize_rows(0, self.out_features, dtype)

    def packed_bytes(self) -> int:
        """Bytes of the packed weight, scales and zeros (bias excluded)."""
        return sum(b.numel() * b.element_size() for name, b in self.named_buffers()
                   if name != "bias" and b is not None)

    def build_cpu_gemms(self, dtype: torch.dtype) -> list | None:
        """Packed CPU GEMMs for ``dtype`` activations, one per output-row segment (see
        :mod:`.cpu_packed`), or None where this layer has none (the slab path runs)."""
        return None

    def cpu_gemms(self, dtype: torch.dtype) -> list | None:
        """:meth:`build_cpu_gemms`, built once per layer and activation dtype."""
        cache = self.__dict__.setdefault("_cpu_gemms", {})
        if dtype not in cache:
            cache[dtype] = self.build_cpu_gemms(dtype)
        return cache[dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [num_tokens, in_features] -> [num_tokens, out_features]`` in ``x.dtype``.

        On CPU with bf16/fp16 activations, layers with packed CPU GEMMs run those; others
        dequantize slabs.
        """
        if x.device.type == "cpu" and x.dtype in PACKED_ACTIVATION_DTYPES:
            gemms = self.cpu_gemms(x.dtype)
            if gemms is not None:
                y = packed_cpu_forward(gemms, x, self.out_features)
                return y if self.bias is None else y + self.bias.to(y.dtype)
        xg = x.to(self.gemm_dtype)
        step = self.max_rows_per_slab
        if step >= self.out_features:
            y = F.linear(xg, self.dequantize_rows(0, self.out_features, self.gemm_dtype))
        else:
            y = torch.empty(*x.shape[:-1], self.out_features, dtype=self.gemm_dtype,
                            device=x.device)
            for start in range(0, self.out_features, step):
                end = min(self.out_features, start + step)
                y[..., start:end] = F.linear(xg, self.dequantize_rows(start, end,
                                                                     self.gemm_dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        """Logical shape and GEMM dtype, shown by ``print(model)``."""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"gemm_dtype={self.gemm_dtype}")
