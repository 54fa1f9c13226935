"""GPU kernels (Triton) for the engine's hot path, each beside its torch reference.

Every module holds one concept: a ``@triton.jit`` kernel, its Python launcher, and a
``*_reference`` function in plain torch that defines what the kernel computes (the tests
compare the two under ``TRITON_INTERPRET=1`` on CPU, and ``bench/gpu_bench.py`` on CUDA).

| module | kernel |
|---|---|
| ``kv_store`` | write new K/V into the paged cache; fused FP8 e4m3 quantization with one scale per (block, KV head), the wire format's quantization |
| ``decode_attention`` | paged decode attention (one query token per request, GQA, FP8 KV) |
| ``prefill_attention`` | varlen causal prefill attention over the paged cache, cached prefixes included |
| ``rmsnorm`` | RMSNorm with the fused residual add |
| ``rotary`` | rotary embedding of q and k in one pass |

Triton decides at decoration time whether a kernel is compiled or interpreted, from
``TRITON_INTERPRET``: set it before importing this package to run the kernels on CPU tensors.
"""

from __future__ import annotations

#: ``slot_mapping`` entry of a padded token (CUDA-graph padding): nothing is stored.
PAD_SLOT_ID = -1


def is_interpreted(kernel: object) -> bool:
    """Whether a ``@triton.jit`` kernel was built for Triton's CPU interpreter."""
    import triton  # noqa: PLC0415  (the package itself stays importable without Triton)

    return not isinstance(kernel, triton.runtime.JITFunction)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``): Triton tile sizes must be powers of 2."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
