"""bf16-weight GEMV for x86 CPUs with AVX2/FMA but no native bf16 (a C++ extension).

A decode step at small batch multiplies every weight by a few rows, so it is bound by
streaming the weights from memory. On CPUs without AVX512-BF16/AMX, oneDNN's bf16 GEMM
(``F.linear`` on bf16) converts and multiplies at ~18 GB/s on a 2-core AVX2 EPYC, well
under the memory's ~34 GB/s (``bench/cpu_gemm.py``), and SmolLM2-135M's GEMMs took 16.5 of
a 27 ms decode step. This kernel widens each bf16 weight to fp32 with a shift (bf16 is the
top half of an fp32), multiplies by the fp32 activations with FMA into four independent
accumulators per row, and splits the output rows over torch's intra-op threads
(``at::parallel_for``): the arithmetic of a bf16 GEMM with fp32 accumulation, in another
summation order.

The extension is built once per machine (see :mod:`.cpu_build`; it is the fused decode
kernel's module, :mod:`.cpu_decode`); where it cannot be built or the CPU lacks
AVX2/FMA/F16C, :func:`bf16_gemv_module` is None and callers keep ``F.linear``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.kernels.cpu_decode import cpu_decode_module


def bf16_gemv_module():
    """The built extension with its ``gemv(w, x)`` (building it on first use), or None
    where it is unavailable. The kernel's source is the fused decode kernel's
    (``cpu_decode.cpp``): one bf16 GEMV for the eager and the fused paths."""
    return cpu_decode_module()


#: Most rows one kernel call takes (a decode step at batch 1-2, or one request's speculative
#: verification of up to 7 drafts).
MAX_GEMV_ROWS = 8


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` for 1-8 rows with a bf16 weight, fp32 accumulation.

    Args:
        x: ``[M, K]``, ``1 <= M <=`` :data:`MAX_GEMV_ROWS`, any float dtype (computed in fp32).
        weight: ``[N, K]`` bf16, contiguous.

    Returns:
        ``[M, N]`` in ``x.dtype``.

    Raises:
        RuntimeError: when the kernel is unavailable (check :func:`bf16_gemv_module`) or
            the shapes/dtypes do not fit.
    """
    module = bf16_gemv_module()
    if module is None:
        raise RuntimeError("the AVX2 bf16 GEMV kernel is not available on this machine")
    return gemv_linear(x, weight)


def gemv_linear(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` through the kernel, fp32 accumulation, in ``x.dtype``.

    Args:
        x: ``[M, K]``, ``1 <= M <=`` :data:`MAX_GEMV_ROWS`, any float dtype.
        weight: ``[N, K]`` bf16, contiguous; bias: ``[N]`` or None.

    Raises:
        AttributeError: the kernel is unavailable (check :func:`bf16_gemv_module` first).
    """
    y = bf16_gemv_module().gemv(weight.detach(), x.float().contiguous())
    return (y if bias is None else y.add_(bias)).to(x.dtype)


def replace_linears(model: nn.Module, pick: Callable[[nn.Linear], bool],
                    make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace each ``nn.Linear`` of ``model`` that ``pick`` accepts by ``make(layer)``;
    returns the count."""
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and pick(mod)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(mod))
    return len(targets)


class Bf16GemvLinear(nn.Linear):
    """A bf16 ``nn.Linear`` whose decode-sized inputs take the bf16 GEMV kernel of
    this module on a CPU with native bf16 GEMMs (the EAGLE head's
    layers: the target's go through the fused decode kernel). oneDNN's bf16 GEMM at one row
    read the head's weights at ~6-12 GB/s: its five GEMMs took 327 us against the kernel's 167
    us (2-core Xeon with AMX). Same weight and bias tensors as the layer it replaces.

    Args:
        linear: the layer to replace (bf16 weight).
    """

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [num_tokens, in_features] -> [num_tokens, out_features]`` in ``x.dtype``: the
        kernel (fp32 accumulation) for bf16 inputs of at most
        :data:`MAX_GEMV_ROWS` rows, else ``F.linear``."""
        if (x.dtype != torch.bfloat16 or x.dim() != 2 or not 0 < x.shape[0] <= MAX_GEMV_ROWS
                or bf16_gemv_module() is None):
            return F.linear(x, self.weight, self.bias)
        return gemv_linear(x, self.weight, self.bias)


def swap_to_bf16_gemv(model: nn.Module) -> int:
    """Replace every bf16 ``nn.Linear`` of ``model`` by :class:`Bf16GemvLinear`; returns the
    count (0 where the kernel is unavailable)."""
    if bf16_gemv_module() is None:
        return 0
    return replace_linears(
        model, lambda m: type(m) is nn.Linear and m.weight.dtype == torch.bfloat16,
        Bf16GemvLinear)
