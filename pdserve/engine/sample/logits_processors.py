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


#: How many of its most likely tokens (``torch.topk``, sorted) a top-k/top-p row is cut from,
#: tried in turn on the rows the previous size could not settle: a row is settled once its
#: top-k fits, or its candidates hold ``top_p`` of the probability. Rows none settles sort
#: their whole vocabulary. SmolLM2's 49,152 tokens on one Zen 3 core: ``sort`` ~4.6 ms a
#: row, ``topk`` 256 / 4,096 ~0.2 / ~1.0 ms; on held text at temperature 1.0 and top_p 0.9
#: the nucleus is 145 tokens at the median, 2,478 at p99.
TOP_CANDIDATE_SIZES = (256, 4096)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Masks tokens outside each row's top-k and then top-p set with -inf; returns a new tensor.

    top-k keeps exactly ``k`` tokens (ties at the k-th value broken by ``torch.topk``'s
    order). top-p keeps the smallest prefix, by descending probability among the top-k
    survivors, whose cumulative probability reaches ``top_p`` (nucleus sampling, Holtzman et
    al. 2020); the most likely token is always kept. Syncs with the host (how many rows each
    candidate size settles). Each row is cut from its most likely
    tokens (:data:`TOP_CANDIDATE_SIZES`); the probabilities are summed over those alone,
    which is nearer the exact nucleus than a cumulative sum over the whole sorted vocabulary
    in fp32 (that sum's rounding, ~1e-5 over 49,152 tokens, dropped the boundary token of
    ~1.5 % of rows that float64 keeps).

    Args:
        logits: ``[B, V]`` fp32 (already temperature-scaled).
        top_k: ``[B]`` int64, 0 = disabled, or ``None``.
        top_p: ``[B]`` fp32, 1.0 = disabled, or ``None``.

    Returns:
        ``[B, V]`` fp32.
    """
    num_rows, vocab_size = logits.shape
    if (top_k is None and top_p is None) or num_rows == 0:
        return logits
    k = (torch.full((num_rows,), vocab_size, device=logits.device) if top_k is None
         else torch.where(top_k > 0, top_k, vocab_size).clamp_max(vocab_size))  # [B]
    p = torch.ones(num_rows, device=logits.device) if top_p is None else top_p  # [B]
    truncated = (k < vocab_size) | (p < 1.0)
    out = logits.masked_fill(truncated.unsqueeze(1), float("-inf"))
    pending = truncated.nonzero().squeeze(1)  # rows not settled yet
    max_k = int(torch.where(k < vocab_size, k, 0).max())
    for size in TOP_CANDIDATE_SIZES:
        if pending.numel() == 0:
            return out
        values, token_ids, settled = _cut_from_candidates(
            logits[pending], k[pending], p[pending], min(vocab_size, max(size, max_k)))
        rows = pending[settled]
        out[rows] = out[rows].scatter_(1, token_ids[settled], values[settled])
        pending = pending[~settled]
    if pending.numel():
        out[pending] = sort_top_k_top_p(logits[pending], k[pending], p[pending])
    return out


def _cut_from_candidates(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, num: int,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k/top-p among each row's ``num`` most likely tokens (``num`` >= every ``k`` that
    is below ``V``). Returns their kept logits (-inf where dropped) ``[R, num]`` fp32, their
    token ids ``[R, num]`` int64, and ``[R]`` bool: the rest of the row is dropped too (its
    top-k fits, or the candidates hold ``p``), so the row is settled."""
    vocab_size = logits.shape[1]
    cut_by_k = k < vocab_size
    values, token_ids = logits.topk(num, dim=-1)  # descending
    values.masked_fill_(torch.arange(num, device=logits.device) >= k.unsqueeze(1),
                        float("-inf"))
    # probabilities among the top-k survivors: all of them are candidates where k <= num
    log_norm = torch.where(cut_by_k, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - log_norm.unsqueeze(1)).exp()  # [R, num]
    _mask_past_nucleus(values, probs, p)
    return values, token_ids, cut_by_k | (probs.sum(dim=-1) >= p)


def sort_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """:func:`apply_top_k_top_p` by one sort of each row's whole vocabulary (the rows it
    cannot cut from candidates, and its reference in tests).

    Args:
        logits: ``[B, V]`` fp32.
        k: ``[B]`` int64 tokens kept by top-k, ``V`` = disabled.
        p: ``[B]`` fp32, 1.0 = disabled.

    Returns:
        ``[B, V]`` fp32.
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_token_ids = logits.sort(dim=-1, descending=True)  # [B, V]
    positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, V]
    sorted_logits.masked_fill_(positions >= k.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    _mask_past_nucleus(sorted_logits, sorted_probs, p)
    return torch.empty_like(logits).scatter_(1, sorted_token_ids, sorted_logits)


def _mask_past_nucleus(sorted_logits: torch.Tensor, sorted_probs: torch.Tensor,
                       p: torch.Tensor) -> None:
    """Top-p in place on ``[R, N]`` logits sorted descending, with their probabilities: -inf
    where the mass of strictly likelier tokens reaches ``p`` (``[R]``); the first token and
    rows with ``p`` 1.0 (which must not lose a tail to rounding) keep everything."""
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p.unsqueeze(1)
    drop[:, 0] = False
    drop &= (p < 1.0).unsqueeze(1)
    sorted_logits.masked_fill_(drop, float("-inf"))


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
