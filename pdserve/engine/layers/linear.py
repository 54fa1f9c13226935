"""Linear layers for CPUs without native 16-bit dot products.

On x86 CPUs without AVX512-BF16/AMX (or AVX512-FP16 for fp16), PyTorch runs bf16/fp16
GEMMs through a slow emulated path (measured here: ~20 GFLOP/s against ~60-180 GFLOP/s
in fp32 on 2 AVX2 cores). :class:`Fp32GemmLinear` runs such a layer as an fp32 GEMM over
upcast operands and rounds the output back: the same arithmetic as a bf16 GEMM with fp32
accumulation (every bf16/fp16 value is exact in fp32), only the summation order differs.
Activations, the residual stream and the KV cache stay in the model dtype. The swap is a
load-time module replacement; model files are untouched.

Row counts. A decode step multiplies each weight by few rows (batch size, or batch x (k+1)
under speculative decoding), so a CPU GEMM is bound by streaming the weight from memory
and should cost about the same for 1 or 5 rows. With torch 2.13's MKL on the AMD EPYC
(AVX2) machines this project runs on, ``F.linear`` (``x @ W^T``, an NT GEMM) does not:
through SmolLM2-135M's 30 layers plus its LM head it took 37 ms for 1 row and 66 ms for 5,
and the cost jumps at some row counts (15 rows cost 2x 16). :func:`cpu_linear` computes
``(W @ x^T)^T`` (an NN GEMM over the transposed view of ``x``, same weight layout) with the
rows padded up to the next count in :data:`PADDED_ROWS` (zero rows, sliced off): 24 ms for
1 row (padded to 2), 25 ms for 4, 32 ms for 5. Above :data:`MAX_PADDED_ROWS` rows (prefill)
the GEMM is compute-bound and ``F.linear`` is faster again. ``bench/cpu_gemm.py`` measures
the table on another CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.kernels.cpu_gemv import (
    MAX_GEMV_ROWS,
    bf16_gemv_module,
    gemv_linear,
    replace_linears,
)

#: bf16 inputs with at most this many rows (a decode step at batch 1-2) run as a bf16 GEMM
#: even where the CPU has no native bf16: oneDNN's bf16 GEMV reads half the bytes of the
#: fp32 weight and, bound by memory, ran SmolLM2's GEMMs in 28 ms against fp32's 57 ms at
#: 1 row (48 vs 56 at 2; 82 vs 61 at 4) on a 2-core AVX2 EPYC (``bench/cpu_gemm.py``).
MAX_BF16_GEMV_ROWS = 2

#: CPU flags (from /proc/cpuinfo) that give native GEMMs for a 16-bit dtype.
NATIVE_CPU_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


#: Row counts :func:`cpu_linear` pads to (cheapest count >= the actual one, measured; see
#: the module docstring and ``bench/cpu_gemm.py``).
PADDED_ROWS = (2, 4, 5, 6, 8, 16, 24, 32, 48, 64, 80)
#: Above this many rows :func:`cpu_linear` is ``F.linear``.
MAX_PADDED_ROWS = PADDED_ROWS[-1]
_PAD_TO = [0] + [next(p for p in PADDED_ROWS if p >= m) for m in range(1, MAX_PADDED_ROWS + 1)]


def cpu_linear(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` for a CPU decode step, as ``(weight @ x_padded^T)^T``.

    Same value as ``F.linear`` up to the summation order (see the module docstring for why
    the form and the padding). Zero rows appended for padding do not change the real rows.

    Args:
        x: ``[num_rows, in_features]``, the dtype of ``weight`` (other shapes go to
            ``F.linear``).
        weight: ``[out_features, in_features]``, contiguous.
        bias: ``[out_features]`` or None.

    Returns:
        ``[num_rows, out_features]`` contiguous, in ``weight.dtype``.
    """
    rows = x.shape[0] if x.dim() == 2 else 0
    if not 0 < rows <= MAX_PADDED_ROWS:
        return F.linear(x, weight, bias)
    padded = _PAD_TO[rows]
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    y = torch.mm(weight, x.t())[:, :rows].t().contiguous()
    return y if bias is None else y.add_(bias)


def cpu_has_native_gemm(dtype: torch.dtype, cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes ``dtype`` GEMMs natively (fp32 always does).

    Non-x86 CPUs (no /proc/cpuinfo flags line) are assumed native.
    """
    if dtype not in NATIVE_CPU_FLAGS:
        return True
    try:
        text = cpuinfo.read_text()
    except OSError:
        return True
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return any(f in flags for f in NATIVE_CPU_FLAGS[dtype])
    return True


class Fp32GemmLinear(nn.Linear):
    """``y = x @ W^T + b`` computed in fp32, output in the input dtype.

    Holds the weight in fp32 (prepacked once at load), so weight memory is that of fp32. A
    subclass of ``nn.Linear`` (same ``weight``/``bias``/feature attributes), so code that
    works on dense linear layers (AWQ search, checkpoint writing) takes it as one.

    Args:
        linear: the loaded layer to replace; its weight/bias are copied to fp32.
    """

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a fresh weight
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().float(), requires_grad=False))

    def bf16_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight [out, in], bias [out] or None)`` rounded to bf16, made on first use and
        kept (the decode GEMVs' copy: this module's bf16 path and the fused CPU kernel)."""
        copies = self.__dict__.get("_weight_bf16")
        if copies is None:
            copies = self.__dict__["_weight_bf16"] = (
                self.weight.to(torch.bfloat16),
                None if self.bias is None else self.bias.to(torch.bfloat16))
        return copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [num_tokens, in_features] -> [num_tokens, out_features]`` in ``x.dtype``.

        bf16 inputs of at most :data:`MAX_BF16_GEMV_ROWS` rows run a bf16 GEMM instead,
        over a bf16 copy of the weight made on the first such call (see the module
        docstring); it rounds the weight exactly as a bf16 model holds it. That GEMM is
        the AVX2 kernel of :mod:`pdserve.engine.kernels.cpu_gemv` where it is built (up to
        its :data:`~pdserve.engine.kernels.cpu_gemv.MAX_GEMV_ROWS` rows: decode batches and
        speculative verification), else oneDNN's (``F.linear``, up to 2 rows).
        """
        kernel = bf16_gemv_module() if x.dtype == torch.bfloat16 else None
        max_rows = MAX_GEMV_ROWS if kernel is not None else MAX_BF16_GEMV_ROWS
        if x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= max_rows:
            copies = self.bf16_weights()
            if kernel is None:
                return F.linear(x, *copies)
            return gemv_linear(x, *copies)
        return cpu_linear(x.float(), self.weight, self.bias).to(x.dtype)


def wants_fp32_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model in ``dtype`` on ``device`` runs its dense layers as
    :class:`Fp32GemmLinear`: on CPU, for fp32 models (for :func:`cpu_linear`'s row padding)
    and for 16-bit models this CPU has no native GEMM for."""
    return device.type == "cpu" and (dtype == torch.float32 or not cpu_has_native_gemm(dtype))


def swap_to_fp32_gemm(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by :class:`Fp32GemmLinear`; returns the count."""
    if any(isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16
           for m in model.modules()):
        bf16_gemv_module()  # build (once per machine) or load the decode GEMV kernel now
    return replace_linears(model, lambda m: not isinstance(m, Fp32GemmLinear), Fp32GemmLinear)
