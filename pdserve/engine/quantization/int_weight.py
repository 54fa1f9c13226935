"""Group-wise integer weights (4 or 8 bits): the canonical form every int format loads into.

A logical weight ``W [out, in]`` is cut along the input dimension into groups of
``group_size`` columns; each (row, group) has a scale ``s`` and an integer zero point ``z``::

    W[o, i] ~= (q[o, i] - z[o, g(i)]) * s[o, g(i)],   q in [0, 2**bits - 1]

The zero point is an integer (uint8; what AWQ/GPTQ/compressed-tensors store) or, for the
"min" form llama.cpp's Q4_1/Q4_K use (``W ~= q * s + min``), a float16 ``z = -min / s``.
``g(i) = i // group_size`` (the last group may be shorter when ``group_size`` does not divide
``in``, e.g. 576 columns in groups of 128), or ``g_idx[i]`` for GPTQ act-order checkpoints (Frantar et al.
2023), whose columns are quantized in a permuted order. AWQ, GPTQ and compressed-tensors
checkpoints all unpack into :class:`IntWeight`; :mod:`.int_layouts` converts to and from
their packed layouts, :class:`~.int_linear.IntLinear` computes with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IntWeight:
    """Unpacked group-quantized weight.

    Attributes:
        codes: ``[out, in]`` uint8, values in ``[0, 2**bits - 1]``.
        scales: ``[out, num_groups]`` float16.
        zeros: ``[out, num_groups]`` uint8 (``2**(bits-1)`` everywhere for symmetric), or
            float16 for the float "min" form (in-memory only: packed checkpoint layouts
            store integer zeros).
        bits: 4 or 8.
        group_size: columns per group (``in`` for one group per row).
        g_idx: ``[in]`` int32 group of each column, or None for ``i // group_size``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int
    g_idx: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        out_features, in_features = self.codes.shape
        num_groups = -(-in_features // self.group_size)
        if self.g_idx is None and self.scales.shape[1] != num_groups:
            raise ValueError(f"{self.scales.shape[1]} groups do not fit in_features "
                             f"{in_features} at group_size {self.group_size}")
        if self.scales.shape != self.zeros.shape or self.scales.shape[0] != out_features:
            raise ValueError(f"scales {tuple(self.scales.shape)} / zeros "
                             f"{tuple(self.zeros.shape)} do not fit codes "
                             f"{tuple(self.codes.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)`` of the logical weight (the codes' shape)."""
        return tuple(self.codes.shape)

    def group_index(self) -> torch.Tensor:
        """``[in]`` int64: the group of each input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.codes.shape[1], device=self.codes.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Reference dequantization: ``[out, in]`` in ``dtype`` (computed in fp32)."""
        gi = self.group_index()
        s = self.scales.float()[:, gi]
        z = self.zeros.float()[:, gi]
        return ((self.codes.float() - z) * s).to(dtype)

    def rows(self, start: int, end: int) -> "IntWeight":
        """The weight of output rows ``start:end`` (views where possible)."""
        return IntWeight(self.codes[start:end], self.scales[start:end], self.zeros[start:end],
                         self.bits, self.group_size, self.g_idx)


def cat_rows(parts: list[IntWeight]) -> IntWeight:
    """Stack the rows of several weights with the same input side (q/k/v, gate/up).

    Raises:
        ValueError: the parts differ in bits, group size, number of groups or ``g_idx``.
    """
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.scales.shape[1]) != (first.bits, first.group_size,
                                                         first.scales.shape[1]):
            raise ValueError("fused projections must share bits and group size")
        if (p.g_idx is None) != (first.g_idx is None) or (
                p.g_idx is not None and not torch.equal(p.g_idx, first.g_idx)):
            raise ValueError("fused projections must share the same g_idx (act order)")
    return IntWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                     torch.cat([p.zeros for p in parts]), first.bits, first.group_size,
                     first.g_idx)


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int,
                 symmetric: bool = False, float_zeros: bool = False) -> IntWeight:
    """Round-to-nearest group quantization of ``weight``.

    Asymmetric (default): per group ``s = (max - min) / (2**bits - 1)``,
    ``z = round(-min / s)``; symmetric: ``s = absmax / (2**(bits-1) - 1)``, ``z = 2**(bits-1)``.
    ``float_zeros`` keeps ``z = -min / s`` unrounded (float16), so each group's minimum is
    represented exactly instead of being moved by up to ``s / 2``: the Q4_1 "min" form.
    On weights that come from a Q4_1 GGUF (as SmolLM2's do) with groups on its 32-column
    blocks, this reproduces the source grid; integer zeros cost SmolLM2 ~+20 % perplexity
    at int4/g32, float zeros ~0.
    Codes are rounded against the float16-rounded scale, so dequantizing the result is exactly
    what the engine computes.

    Args:
        weight: ``[out, in]`` float.
        bits: 4 or 8.
        group_size: columns per group; -1 (or ``in``) for one group per row.
        symmetric: symmetric codes around ``2**(bits-1)``.
        float_zeros: float16 zero points (asymmetric only).

    Raises:
        ValueError: bad bits or group size, or ``symmetric`` with ``float_zeros``.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    out_features, in_features = weight.shape
    if group_size == -1:
        group_size = in_features
    if group_size <= 0:
        raise ValueError(f"group_size must be positive or -1, got {group_size}")
    if symmetric and float_zeros:
        raise ValueError("float_zeros applies to asymmetric quantization only")
    max_q = 2**bits - 1
    w = weight.float()
    pad = (-in_features) % group_size
    if pad:  # repeat the last column: the short last group keeps its own min/max
        w = torch.cat((w, w[:, -1:].expand(out_features, pad)), dim=1)
    w = w.reshape(out_features, -1, group_size)
    if symmetric:
        half = 2 ** (bits - 1)
        scales = (w.abs().amax(-1) / (half - 1)).clamp(min=1e-8).half()
        zeros = torch.full_like(scales, half, dtype=torch.float32)
    else:
        w_max, w_min = w.amax(-1), w.amin(-1)
        scales = ((w_max - w_min) / max_q).clamp(min=1e-8).half()
        zeros = -w_min / scales.float()
        zeros = zeros.half().float() if float_zeros else zeros.round().clamp(0, max_q)
    sf = scales.float().clamp(min=6e-8)
    codes = (w / sf[..., None] + zeros[..., None]).round()
    codes = codes.clamp(0, max_q).to(torch.uint8).reshape(out_features, -1)[:, :in_features]
    zeros = zeros.half() if float_zeros else zeros.to(torch.uint8)
    return IntWeight(codes.contiguous(), scales, zeros, bits, group_size)
