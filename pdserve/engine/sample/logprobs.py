"""Logprobs of the model's raw distribution: gathered on the device, then turned into the
:class:`TokenLogprob` objects a request returns (generated tokens and prompt tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.engine.outputs import TokenLogprob

#: Prompt rows per LM-head call when computing prompt logprobs (bounds ``[rows, vocab]``).
PROMPT_LOGPROBS_SLICE = 256


@dataclass
class LogprobsTensors:
    """Logprobs of the model's raw distribution (see :mod:`pdserve.engine.sample.sampler`)."""

    sampled_logprobs: torch.Tensor  # [B] fp32, logprob of the sampled token
    sampled_ranks: torch.Tensor  # [B] int64, 1 + number of tokens strictly more likely
    top_token_ids: torch.Tensor  # [B, K] int64, most likely first (K may be 0)
    top_logprobs: torch.Tensor  # [B, K] fp32, descending


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor,
                    num_top: int) -> LogprobsTensors:
    """Logprobs of the sampled ``[B]`` int64 tokens and the ``num_top`` best, from
    ``[B, V]`` fp32 raw logprobs."""
    sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1
    top_logprobs, top_token_ids = raw_logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(
        sampled_logprobs=sampled_logprobs.squeeze(1),
        sampled_ranks=ranks,
        top_token_ids=top_token_ids,
        top_logprobs=top_logprobs,
    )


def token_logprobs(requests: list, emitted: list[list[int]],
                   lp: LogprobsTensors | None) -> list[list[TokenLogprob] | None]:
    """Per request, TokenLogprob objects for its emitted tokens (rows in emission order);
    None for a request that did not ask for logprobs."""
    out: list[list[TokenLogprob] | None] = []
    row = 0
    if lp is not None and lp.sampled_logprobs.device.type != "cpu":
        lp = LogprobsTensors(*(t.cpu() for t in (
            lp.sampled_logprobs, lp.sampled_ranks, lp.top_token_ids, lp.top_logprobs)))
    for req, tokens in zip(requests, emitted):
        k = req.sampling_params.logprobs
        if k is None or lp is None:
            out.append(None)
            row += len(tokens)
            continue
        items = []
        for token_id in tokens:
            items.append(TokenLogprob(
                token_id=token_id, logprob=float(lp.sampled_logprobs[row]),
                rank=int(lp.sampled_ranks[row]), top_token_ids=lp.top_token_ids[row, :k].tolist(),
                top_logprobs=lp.top_logprobs[row, :k].tolist()))
            row += 1
        out.append(items)
    return out


def prompt_logprobs(hidden: torch.Tensor, scheduled: list, query_starts: list[int],
                    compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    ) -> dict[str, list[TokenLogprob]]:
    """Logprobs of the prompt tokens this step's prefill rows predict, per request id.

    Row ``i`` of a request's chunk (position ``p``) scores prompt token ``p + 1`` under
    the raw model (no penalties, temperature or grammar, as in vLLM). Positions already
    collected (before a preemption) are skipped. Rows go through the LM head in slices
    of :data:`PROMPT_LOGPROBS_SLICE` so a long chunk never holds ``[L, vocab]`` logits.

    Args:
        hidden: ``[num_tokens, hidden_size]`` the step's hidden states.
        scheduled: the step's :class:`~pdserve.engine.scheduler.ScheduledRequest` list.
        query_starts: each scheduled request's first row in ``hidden``.
        compute_logits: ``[rows, hidden_size] -> [rows, vocab]`` fp32 (the LM head).
    """
    out: dict[str, list[TokenLogprob]] = {}
    for s, q0 in zip(scheduled, query_starts):
        req = s.request
        if not req.needs_prompt_logprobs:
            continue
        start = req.num_computed_tokens
        first = max(start, len(req.prompt_logprobs))
        last = min(start + s.num_new_tokens, req.num_prompt_tokens - 1)  # exclusive
        if first >= last:
            continue
        k = req.sampling_params.prompt_logprobs
        items: list[TokenLogprob] = []
        for a in range(first, last, PROMPT_LOGPROBS_SLICE):
            b = min(last, a + PROMPT_LOGPROBS_SLICE)
            logits = compute_logits(hidden[q0 + a - start:q0 + b - start])
            raw = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor(req.token_ids[a + 1:b + 1], dtype=torch.int64,
                                   device=raw.device)
            lp = gather_logprobs(raw, targets, k)
            vals, ranks = lp.sampled_logprobs.tolist(), lp.sampled_ranks.tolist()
            top_ids, top_lps = lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
            items.extend(TokenLogprob(t, v, r, ti, tl) for t, v, r, ti, tl in zip(
                req.token_ids[a + 1:b + 1], vals, ranks, top_ids, top_lps))
        out[req.request_id] = items
    return out
