"""Causal prefill attention on CPUs with AVX512-BF16 (``cpu_prefill_attention.cpp``).

torch's CPU flash-attention kernel ran a 1,500-token bf16 prefill of SmolLM2 (9 query /
3 KV heads of 64) at 51 ms a layer on one Zen 4 core, about 25 GFLOP/s, as much time as
all of the step's GEMMs; this kernel computes scores and the probability-weighted values
with AVX512-BF16 dot products over key blocks packed for them, and keeps each block's
scores in registers and L1 (FlashAttention's online softmax, Dao et al. 2022). It runs
where the CPU has AVX512-BF16 and no AMX, or where ``PDSERVE_PREFILL_ATTENTION=cpu`` asks
for it; ``PDSERVE_PREFILL_ATTENTION=torch`` turns it off. Where the CPU has AMX, torch's
kernel multiplies in AMX tiles and is 2-3x faster than this one (2-core Xeon, SmolLM2's
heads, one layer: 1,500 tokens 5.4 against 14.1 ms, 3,000 tokens 18.0 against 55.3 ms), so
there the eager path takes torch's, and the fused kernel's prefill chunks take the AMX kernel
(``cpu_amx_attention.cpp``, head_dim 64: 1,500 tokens 3.8 ms a layer) or torch's.
"""

from __future__ import annotations

import os

import torch

from pdserve.engine.kernels.cpu_build import cpu_flags
from pdserve.engine.kernels.cpu_decode import cpu_decode_module

#: Head sizes the kernel takes.
HEAD_DIMS = (32, 64, 128)
_state: dict[str, bool] = {}


def prefill_attention_module():
    """The AVX512-BF16 build of the CPU kernels (``cpu_decode.cpp`` with this kernel in one
    translation unit, built on first use), or None where the CPU lacks AVX512-BF16,
    kernels are disabled or the build failed."""
    module = cpu_decode_module("avx512_bf16")
    return module if hasattr(module, "prefill_attention") else None


def use_cpu_prefill_attention() -> bool:
    """True where prefills should take this kernel (see the module docstring)."""
    choice = os.environ.get("PDSERVE_PREFILL_ATTENTION", "")
    if choice == "torch":
        return False
    if choice != "cpu" and "amx_bf16" in cpu_flags():
        return False
    return prefill_attention_module() is not None


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_context: int,
                      scale: float) -> torch.Tensor:
    """Causal attention of ``n`` prefill queries after ``num_context`` cached positions.

    Args:
        q: ``[n, H, D]`` bf16 queries (last two dimensions contiguous).
        k, v: ``[num_context + n, Hkv, D]`` bf16 keys and values of the context then the
            chunk (same layout); ``H`` a multiple of ``Hkv``, ``D`` in :data:`HEAD_DIMS`.
        num_context: cached positions before the chunk (0 for a whole prompt).
        scale: softmax scale.

    Returns:
        ``[n, H, D]`` bf16: query ``i`` attends to keys ``0 .. num_context + i``, as
        ``scaled_dot_product_attention`` with that causal mask (within bf16 rounding:
        probabilities are rounded to bf16 before they weigh the values).

    Raises:
        RuntimeError: the kernel is unavailable, or dtypes/shapes/layouts it does not take.
    """
    module = prefill_attention_module()
    if module is None:
        raise RuntimeError("the CPU prefill attention kernel is unavailable here")
    return module.prefill_attention(q, k, v, num_context, scale)


def takes_prefill(dtype: torch.dtype, device: torch.device, head_dim: int,
                  is_eligible: bool = True) -> bool:
    """Whether a prefill of ``dtype`` on ``device`` takes this kernel (bf16, a CPU where
    :func:`use_cpu_prefill_attention`, a head size of :data:`HEAD_DIMS`, and the caller's
    own ``is_eligible``); the CPU check runs once per process."""
    if not (is_eligible and dtype == torch.bfloat16 and device.type == "cpu"
            and head_dim in HEAD_DIMS):
        return False
    if "use" not in _state:
        _state["use"] = use_cpu_prefill_attention()
    return _state["use"]

