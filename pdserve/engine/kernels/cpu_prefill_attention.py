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

Where the CPU has no native bf16 (AVX2 only), 16-bit prefills attend in fp32, and fp32
prefills take ``cpu_flash_f32.cpp`` (AVX2 + FMA, rows of 24 query (token, head) pairs in the
vector lanes, K and V read in place): on a 2-core AVX2 EPYC, SmolLM2's heads, one layer,
against torch's fp32 flash kernel: 1,500 tokens 19-22 against 27-34 ms, 952 after 2,048
40 against 55, 128 tokens 0.16 against 0.46.
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


def use_f32_prefill_attention() -> bool:
    """True where fp32 prefills should take ``cpu_flash_f32.cpp``: CPUs without AVX512-BF16
    (where 16-bit prefills attend in fp32), unless ``PDSERVE_PREFILL_ATTENTION=torch``;
    ``=cpu`` asks for it on any CPU with AVX2 and FMA."""
    choice = os.environ.get("PDSERVE_PREFILL_ATTENTION", "")
    if choice == "torch" or (choice != "cpu" and "avx512_bf16" in cpu_flags()):
        return False
    return hasattr(cpu_decode_module(), "prefill_attention_f32")


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
        q: ``[n, H, D]`` bf16 or fp32 queries (last two dimensions contiguous).
        k, v: ``[num_context + n, Hkv, D]`` keys and values of the context then the
            chunk (same layout); ``H`` a multiple of ``Hkv``, ``D`` in :data:`HEAD_DIMS`.
        num_context: cached positions before the chunk (0 for a whole prompt).
        scale: softmax scale.

    Returns:
        ``[n, H, D]`` in ``q``'s dtype: query ``i`` attends to keys ``0 .. num_context + i``,
        as ``scaled_dot_product_attention`` with that causal mask (bf16: within bf16
        rounding, probabilities are rounded to bf16 before they weigh the values; fp32:
        within fp32 rounding, ``cpu_flash_f32.cpp``).

    Raises:
        RuntimeError: the kernel is unavailable, or dtypes/shapes/layouts it does not take.
    """
    if q.dtype == torch.float32:
        module = cpu_decode_module()
        if module is None or not hasattr(module, "prefill_attention_f32"):
            raise RuntimeError("the CPU fp32 prefill attention kernel is unavailable here")
        return module.prefill_attention_f32(q, k, v, num_context, scale)
    module = prefill_attention_module()
    if module is None:
        raise RuntimeError("the CPU prefill attention kernel is unavailable here")
    return module.prefill_attention(q, k, v, num_context, scale)


def takes_prefill(dtype: torch.dtype, device: torch.device, head_dim: int,
                  is_eligible: bool = True) -> bool:
    """Whether a prefill of ``dtype`` on ``device`` takes these kernels (bf16 on a CPU where
    :func:`use_cpu_prefill_attention`, fp32 where :func:`use_f32_prefill_attention`, a head
    size of :data:`HEAD_DIMS`, and the caller's own ``is_eligible``); the CPU checks run once
    per process."""
    if not (is_eligible and dtype in (torch.bfloat16, torch.float32) and device.type == "cpu"
            and head_dim in HEAD_DIMS):
        return False
    key = str(dtype)
    if key not in _state:
        _state[key] = (use_cpu_prefill_attention() if dtype == torch.bfloat16
                       else use_f32_prefill_attention())
    return _state[key]

