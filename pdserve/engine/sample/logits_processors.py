"""Batched logits transforms: penalties, top-k/top-p and min-p truncation."""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Applies repetition, then presence and frequency penalties; returns a new tensor.

    - Repetition (CTRL / transformers): for every token seen in the prompt or the output,
      a positive logit is divided by the penalty and a negative one multiplied by it.
    - Presence / frequency (OpenAI), over output tokens only:
      ``logit -= presence * (count > 0) + frequency * count``.

    Args:
        logits: ``[B, V]`` fp32.
        prompt_token_ids: ``[B, P]`` int64, right-padded with ``V``.
        output_token_ids: ``[B, O]`` int64, right-padded with ``V``.
        presence_penalties / frequency_penalties / repetition_penalties: ``[B]`` fp32.

    Returns:
        ``[B, V]`` fp32 penalized logits.
    """
    num_rows, vocab_size = logits.shape
    # Scatter into V + 1 columns so the pad id V lands in a column that is dropped.
    output_counts = torch.zeros(
        num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device
    )
    output_counts.scatter_add_(
        1, output_token_ids, torch.ones_like(output_token_ids, dtype=logits.dtype)
    )
    output_counts = output_counts[:, :vocab_size]  # [B, V] fp32
    seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, prompt_token_ids, True)
    seen = seen[:, :vocab_size] | (output_counts > 0)  # [B, V] bool

    repetition = repetition_penalties.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency_penalties.unsqueeze(1) * output_counts
    return logits - presence_penalties.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Masks tokens outside each row's top-k and then top-p set with -inf; returns a new tensor.

    top-k keeps exactly ``k`` tokens (ties at the k-th value broken by sort order).
    top-p keeps the smallest prefix, by descending probability among the top-k survivors,
    whose cumulative probability reaches ``top_p``; the most likely token is always kept.

    Args:
        logits: ``[B, V]`` fp32 (already temperature-scaled).
        top_k: ``[B]`` int64, 0 = disabled, or ``None``.
        top_p: ``[B]`` fp32, 1.0 = disabled, or ``None``.

    Returns:
        ``[B, V]`` fp32.
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    sorted_logits, sorted_token_ids = logits.sort(dim=-1, descending=True)  # [B, V]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).unsqueeze(1)  # [B, 1]
        positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, V]
        sorted_logits.masked_fill_(positions >= k, float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        prob_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly likelier
        drop = prob_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        # A disabled row must not lose its tail to cumsum rounding near 1.0.
        drop &= (top_p < 1.0).unsqueeze(1)
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_token_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens with ``prob < min_p * max_prob`` with -inf; returns a new tensor.

    Args:
        logits: ``[B, V]`` fp32 (already temperature-scaled).
        min_p: ``[B]`` fp32, 0.0 = disabled.

    Returns:
        ``[B, V]`` fp32.
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))
