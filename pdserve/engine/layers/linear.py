"""Linear layers for CPUs without native 16-bit dot products.

On x86 CPUs without AVX512-BF16/AMX (or AVX512-FP16 for fp16), PyTorch runs bf16/fp16
GEMMs through a slow emulated path (measured here: ~20 GFLOP/s against ~60-180 GFLOP/s
in fp32 on 2 AVX2 cores). :class:`Fp32GemmLinear` runs such a layer as an fp32 GEMM over
upcast operands and rounds the output back: the same arithmetic as a bf16 GEMM with fp32
accumulation (every bf16/fp16 value is exact in fp32), only the summation order differs.
Activations, the residual stream and the KV cache stay in the model dtype. The swap is a
load-time module replacement; model files are untouched.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

#: CPU flags (from /proc/cpuinfo) that give native GEMMs for a 16-bit dtype.
NATIVE_CPU_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


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


class Fp32GemmLinear(nn.Module):
    """``y = x @ W^T + b`` computed in fp32, output in the input dtype.

    Holds the weight in fp32 (prepacked once at load), so weight memory is that of fp32.

    Args:
        linear: the loaded layer to replace; its weight/bias are copied to fp32.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().float(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [num_tokens, in_features] -> [num_tokens, out_features]`` in ``x.dtype``."""
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


def swap_to_fp32_gemm(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by :class:`Fp32GemmLinear`; returns the count."""
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp32GemmLinear(mod))
    return len(targets)
