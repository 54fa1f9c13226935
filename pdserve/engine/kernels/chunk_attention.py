"""Attention of a prefill chunk that follows a context, as two flash-attention passes.

A chunk of ``n`` queries after ``c`` context positions attends to all ``c`` context keys and
causally to its own ``n``. Passing that as one attention with a ``[n, c + n]`` bool mask
makes torch's CPU flash kernel visit every masked tile too (the chunk's upper triangle)
and read the mask; instead one unmasked pass over the context and one causal pass over the
chunk's own keys each return their log-sum-exp, and the two are merged exactly (the
online-softmax merge of FlashAttention, Dao et al. 2022). Measured on a 2-core AVX2 EPYC,
fp32, SmolLM2's 9 query / 3 KV heads of 64: a 952-token chunk after 2,048 positions,
56-58 -> 44-46 ms per layer (bench/results/prefill-attention-2026-12-03-epyc-avx2/).
"""

from __future__ import annotations

import torch

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def context_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_context: int,
                        scale: float) -> torch.Tensor:
    """Attention of a chunk over its context then itself, on CPU.

    Args:
        q: ``[1, H, n, D]`` queries of the chunk's ``n`` tokens (fp32/bf16/fp16).
        k, v: ``[1, Hkv, num_context + n, D]`` keys/values of the context then the chunk,
            same dtype; ``H`` a multiple of ``Hkv`` (grouped-query attention, native).
        num_context: context positions before the chunk (>= 1).
        scale: softmax scale.

    Returns:
        ``[1, H, n, D]`` in ``q``'s dtype: query ``i`` attends to every context position
        and to the chunk's positions ``<= i``, as ``scaled_dot_product_attention`` with
        the bottom-right causal mask (within float rounding: merged in fp32).

    Raises:
        RuntimeError: from torch, for tensors not on the CPU or mismatched shapes.
    """
    out_ctx, lse_ctx = _flash_cpu(q, k[:, :, :num_context], v[:, :, :num_context], 0.0,
                                  False, scale=scale)[:2]
    out_own, lse_own = _flash_cpu(q, k[:, :, num_context:], v[:, :, num_context:], 0.0,
                                  True, scale=scale)[:2]
    lse = torch.logaddexp(lse_ctx, lse_own)  # [1, H, n] fp32
    out = (out_ctx.float() * torch.exp(lse_ctx - lse)[..., None]
           + out_own.float() * torch.exp(lse_own - lse)[..., None])
    return out.to(q.dtype)
