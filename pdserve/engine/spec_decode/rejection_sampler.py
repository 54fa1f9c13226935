"""Batched verification of chain drafts by rejection sampling.

NOTE: the core invariant. For every request, the emitted tokens are distributed exactly as if
they had been sampled one at a time from the target's (processed) distribution ``p``, whatever
the draft distribution ``q`` is (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Alg. 1 / Thm. 1; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling", Alg. 2). ``q`` only changes how many tokens get accepted.

Layout of one step: request ``i`` proposes ``k_i >= 0`` draft tokens and the target scores
``k_i + 1`` positions; the rows of all requests are concatenated::

    target_logits rows:  | r0: p0 p1 p2 bonus | r1: bonus | r2: p0 p1 bonus |
    draft_token_ids:     | r0: x0 x1 x2       | r1: -     | r2: x0 x1       |

Row ``j < k_i`` of a request is the target's distribution for draft token ``x_j``; row
``k_i`` is the distribution of the bonus token, used only when all drafts are accepted.

Per draft position ``j`` in order:

- greedy request (temperature <= GREEDY_TEMPERATURE): accept ``x_j`` iff it equals the
  argmax of the RAW target logits; otherwise emit that argmax and stop.
- random request: accept ``x_j`` with probability ``min(1, p(x_j) / q(x_j))``; on rejection
  emit a token from ``normalize(max(0, p - q))`` and stop. For a point-mass draft
  (``q = one_hot(x_j)``, e.g. n-gram) this is "accept with probability ``p(x_j)``, else
  sample from ``p`` with ``x_j`` removed".

If all ``k_i`` drafts are accepted, the bonus token is sampled from (greedy: the argmax of)
the last row. Each request therefore emits ``1 .. k_i + 1`` tokens.

``p`` is ``softmax(truncate(logits / T))`` with the same pipeline as the plain sampler
(temperature -> min_p -> top_k -> top_p); the SAME truncation parameters are applied to the
draft's ``q``, which must be the distribution the draft token was actually drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.sample.draws import greedy_tokens, sample_rows
from pdserve.engine.sample.logits_processors import apply_min_p, apply_top_k_top_p
from pdserve.engine.sample.sampling_metadata import SamplingMetadata
from pdserve.engine.sampling_params import GREEDY_TEMPERATURE

#: Fills ``RejectionSamplerOutput.output_token_ids`` past each request's emitted tokens.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class RejectionSamplerOutput:
    """Result of verifying one step's drafts; ``B`` requests, ``K = max_i k_i``."""

    # [B, K + 1] int64: row i holds num_accepted_tokens[i] + 1 emitted ids, then
    # PLACEHOLDER_TOKEN_ID.
    output_token_ids: torch.Tensor
    num_accepted_tokens: torch.Tensor  # [B] int64, accepted draft tokens (0 .. k_i)

    def to_lists(self) -> tuple[list[list[int]], list[int]]:
        """Per request the emitted token ids, and the accepted counts. The one host sync."""
        num_accepted = self.num_accepted_tokens.tolist()
        rows = self.output_token_ids.tolist()
        return [row[: n + 1] for row, n in zip(rows, num_accepted)], num_accepted


@dataclass
class _StepRows:
    """Where each request's rows and drafts are in one step's concatenated target rows
    (``N = sum_i (k_i + 1)`` rows, ``D = sum_i k_i`` drafts). Built from host lists: no
    device -> host sync."""

    cu_num_rows: torch.Tensor  # [B] int64: first target row of request i
    request_of_row: torch.Tensor  # [N] int64: the request owning target row r
    draft_rows: torch.Tensor  # [D] int64: target row of each draft token (not the bonus row)
    draft_ids: torch.Tensor  # [D] int64: the draft tokens

    @classmethod
    def build(cls, num_draft: list[int], draft_token_ids: list[list[int]],
              device: torch.device) -> _StepRows:
        """The index tensors of requests with ``num_draft[i]`` drafts each."""
        starts = _cumsum_start(num_draft)
        return cls(
            cu_num_rows=torch.tensor(starts, dtype=torch.int64, device=device),
            request_of_row=torch.tensor(
                [i for i, k in enumerate(num_draft) for _ in range(k + 1)],
                dtype=torch.int64, device=device,
            ),
            draft_rows=torch.tensor(
                [start + j for start, k in zip(starts, num_draft) for j in range(k)],
                dtype=torch.int64, device=device,
            ),
            draft_ids=torch.tensor(
                [t for ids in draft_token_ids for t in ids], dtype=torch.int64, device=device
            ),
        )


class RejectionSampler:
    """Verifies chain drafts against one target forward pass; see the module docstring."""

    def __call__(
        self,
        target_logits: torch.Tensor,
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None],
        metadata: SamplingMetadata,
        default_generator: torch.Generator | None = None,
    ) -> RejectionSamplerOutput:
        """Accepts a prefix of each request's draft and emits one more token.

        Args:
            target_logits: ``[sum_i (k_i + 1), V]`` fp32 raw target logits, requests
                concatenated in order (``k_i + 1`` rows each); never modified.
            draft_token_ids: per request its ``k_i`` draft token ids (``k_i`` may be 0).
            draft_probs: per request ``[k_i, V]`` fp32, the draft's distribution after
                temperature and before top-k / top-p / min-p (they are applied here, as for
                the target), or ``None`` for a point-mass draft (n-gram). Ignored for greedy
                requests.
            metadata: ``B`` rows, one per request: temperature, top_k, top_p, min_p and
                generators (built by :meth:`SamplingMetadata.build`). Logit bias, min_tokens
                and penalties are not supported in verification yet.
            default_generator: noise for random requests without their own generator;
                ``None`` uses torch's global RNG. A request with its own generator draws
                ``k_i`` acceptance uniforms, then ``k_i + 1`` fp64 uniforms for its rows'
                tokens, from it, so its tokens do not depend on the rest of the batch.

        Returns:
            ``RejectionSamplerOutput``; the output distribution of every request equals the
            target's (see the module NOTE).

        Raises:
            ValueError: shapes or lengths disagree, or ``metadata`` needs logit processing.
        """
        num_draft = [len(ids) for ids in draft_token_ids]
        self._check_inputs(target_logits, draft_token_ids, draft_probs, metadata, num_draft)
        rows = _StepRows.build(num_draft, draft_token_ids, target_logits.device)
        row_tokens, is_accepted = self._row_tokens(
            target_logits, rows, draft_probs, num_draft, metadata, default_generator)
        return _accepted_prefixes(rows, num_draft, row_tokens, is_accepted)

    def _row_tokens(
        self,
        target_logits: torch.Tensor,
        rows: _StepRows,
        draft_probs: list[torch.Tensor | None],
        num_draft: list[int],
        metadata: SamplingMetadata,
        default_generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token if emitted there, and whether each draft is accepted.

        Greedy requests compare with (and emit) the raw argmax; random ones go through
        :meth:`_verify_random`; a mixed batch takes each request's own rule.

        Returns:
            ``row_tokens`` ``[N]`` int64 (draft rows: the correction token, used if that
            draft is the first rejected; bonus rows: the bonus token) and ``is_accepted``
            ``[D]`` bool.
        """
        target_argmax = greedy_tokens(target_logits)  # [N] int64
        if metadata.all_greedy:
            return target_argmax, rows.draft_ids == target_argmax[rows.draft_rows]  # [D] bool
        row_tokens, is_accepted = self._verify_random(
            target_logits, rows.draft_rows, rows.draft_ids, draft_probs, num_draft,
            rows.request_of_row, metadata, default_generator,
        )
        if not metadata.all_random:
            is_greedy_row = (metadata.temperature <= GREEDY_TEMPERATURE)[
                rows.request_of_row
            ]  # [N] bool
            row_tokens = torch.where(is_greedy_row, target_argmax, row_tokens)
            greedy_accepted = rows.draft_ids == target_argmax[rows.draft_rows]
            is_accepted = torch.where(is_greedy_row[rows.draft_rows], greedy_accepted,
                                      is_accepted)
        return row_tokens, is_accepted

    @staticmethod
    def _check_inputs(
        target_logits: torch.Tensor,
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None],
        metadata: SamplingMetadata,
        num_draft: list[int],
    ) -> None:
        if target_logits.dim() != 2 or target_logits.dtype != torch.float32:
            raise ValueError(
                f"target_logits must be 2-D fp32, got {tuple(target_logits.shape)} "
                f"{target_logits.dtype}"
            )
        num_requests = len(draft_token_ids)
        if len(draft_probs) != num_requests or metadata.num_rows != num_requests:
            raise ValueError(
                f"draft_token_ids has {num_requests} requests, draft_probs "
                f"{len(draft_probs)}, metadata {metadata.num_rows}"
            )
        expected_rows = sum(num_draft) + num_requests
        if target_logits.shape[0] != expected_rows:
            raise ValueError(
                f"target_logits has {target_logits.shape[0]} rows, expected "
                f"sum(k_i + 1) = {expected_rows}"
            )
        vocab_size = target_logits.shape[1]
        if metadata.vocab_size != vocab_size:
            raise ValueError(
                f"target_logits have {vocab_size} columns, metadata vocab_size is "
                f"{metadata.vocab_size}"
            )
        for i, (ids, probs) in enumerate(zip(draft_token_ids, draft_probs)):
            if any(not 0 <= t < vocab_size for t in ids):
                raise ValueError(f"draft_token_ids[{i}] has ids outside [0, {vocab_size})")
            if probs is not None and tuple(probs.shape) != (len(ids), vocab_size):
                raise ValueError(
                    f"draft_probs[{i}] must be [{len(ids)}, {vocab_size}], "
                    f"got {tuple(probs.shape)}"
                )
        if metadata.needs_logit_processing:
            raise ValueError(
                "logit_bias, min_tokens and penalties are not supported with speculative decoding"
            )

    @staticmethod
    def _verify_random(
        target_logits: torch.Tensor,
        draft_rows: torch.Tensor,
        draft_ids: torch.Tensor,
        draft_probs: list[torch.Tensor | None],
        num_draft: list[int],
        request_of_row: torch.Tensor,
        metadata: SamplingMetadata,
        default_generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling for all rows (greedy rows are overwritten by the caller).

        Returns:
            ``row_tokens`` ``[N]`` int64 (draft rows: a residual sample, used if that draft
            is the first rejected; bonus rows: a sample from ``p``) and ``is_accepted``
            ``[D]`` bool.
        """
        temperature = torch.where(
            metadata.temperature <= GREEDY_TEMPERATURE, 1.0, metadata.temperature
        )
        target_probs = truncated_probs(
            target_logits / temperature[request_of_row].unsqueeze(1),
            metadata, request_of_row,
        )  # [N, V] fp32
        draft_q = _draft_distribution(
            draft_ids, draft_probs, num_draft, target_logits.shape[1]
        )  # [D, V] fp32
        draft_q = truncated_probs(
            draft_q.log(), metadata, request_of_row[draft_rows]
        )  # [D, V] fp32, same truncation as the target

        uniform, row_uniform = _draw_noise(
            num_draft, metadata, default_generator, target_logits.device,
        )  # [D] fp32, [N] fp64
        p_draft = target_probs[draft_rows]  # [D, V]
        p_of_x = p_draft.gather(1, draft_ids.unsqueeze(1)).squeeze(1)  # [D]
        q_of_x = draft_q.gather(1, draft_ids.unsqueeze(1)).squeeze(1)  # [D]
        # u < p / q without dividing: a token the draft could not have drawn (q = 0) is
        # accepted only if the target allows it.
        is_accepted = uniform * q_of_x < p_of_x  # [D] bool

        residual = (p_draft - draft_q).clamp_min_(0.0)  # [D, V]
        # p == q (to rounding) leaves no residual; then rejection has probability ~0 anyway.
        residual_is_empty = residual.sum(dim=1, keepdim=True) <= 0.0
        residual = torch.where(residual_is_empty, p_draft, residual)
        sampling_probs = target_probs.clone()
        sampling_probs[draft_rows] = residual  # unnormalized weights are fine
        # Inverse transform sampling: i with probability w_i / sum(w).
        row_tokens = sample_rows(sampling_probs, row_uniform)  # [N] int64
        return row_tokens, is_accepted


def _accepted_prefixes(rows: _StepRows, num_draft: list[int], row_tokens: torch.Tensor,
                       is_accepted: torch.Tensor) -> RejectionSamplerOutput:
    """Each request's accepted prefix of drafts, then the token of the row after it.

    Args:
        rows: the step's index tensors.
        num_draft: ``k_i`` per request.
        row_tokens: ``[N]`` int64, the token emitted when a request stops at that row.
        is_accepted: ``[D]`` bool, per draft token.
    """
    num_requests = len(num_draft)
    max_num_draft = max(num_draft, default=0)
    device = rows.cu_num_rows.device
    request_of_draft = rows.request_of_row[rows.draft_rows]  # [D] int64
    position_of_draft = rows.draft_rows - rows.cu_num_rows[request_of_draft]  # [D] int64
    # [B, K] padded views; padding is "rejected" so it never extends the accepted prefix.
    accepted_padded = torch.zeros(num_requests, max_num_draft, dtype=torch.bool, device=device)
    accepted_padded[request_of_draft, position_of_draft] = is_accepted
    num_accepted = accepted_padded.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B] int64

    output = torch.full(
        (num_requests, max_num_draft + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
        device=device,
    )
    output[request_of_draft, position_of_draft] = rows.draft_ids
    positions = torch.arange(max_num_draft + 1, device=device).unsqueeze(0)  # [1, K + 1]
    output.masked_fill_(positions >= num_accepted.unsqueeze(1), PLACEHOLDER_TOKEN_ID)
    # The token after the accepted prefix: the correction (or bonus) token of that row.
    last_tokens = row_tokens[rows.cu_num_rows + num_accepted]  # [B] int64
    output.scatter_(1, num_accepted.unsqueeze(1), last_tokens.unsqueeze(1))
    return RejectionSamplerOutput(output_token_ids=output, num_accepted_tokens=num_accepted)


def _cumsum_start(counts: list[int]) -> list[int]:
    """First target row of each request: exclusive prefix sum of ``k_i + 1``."""
    starts, total = [], 0
    for k in counts:
        starts.append(total)
        total += k + 1
    return starts


def _draft_distribution(
    draft_ids: torch.Tensor, draft_probs: list[torch.Tensor | None], num_draft: list[int],
    vocab_size: int,
) -> torch.Tensor:
    """``[D, V]`` fp32 draft distributions; a point-mass draft (``None``) becomes one-hot rows."""
    rows = [
        probs.to(torch.float32) if probs is not None
        else torch.nn.functional.one_hot(ids, vocab_size).to(torch.float32)
        for probs, ids in zip(draft_probs, draft_ids.split(num_draft))
    ]
    if not rows:
        return torch.zeros(0, vocab_size, dtype=torch.float32, device=draft_ids.device)
    return torch.cat(rows)


def truncated_probs(
    logits: torch.Tensor, metadata: SamplingMetadata, request_of_row: torch.Tensor
) -> torch.Tensor:
    """min_p, top_k, top_p of each row's request, then softmax.

    Args:
        logits: ``[R, V]`` fp32, temperature already applied (log-probs work too).
        request_of_row: ``[R]`` int64, the request (metadata row) of each logits row.

    Returns:
        ``[R, V]`` fp32 probabilities.
    """
    def per_row(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values[request_of_row]

    min_p = per_row(metadata.min_p)
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    logits = apply_top_k_top_p(logits, per_row(metadata.top_k), per_row(metadata.top_p))
    return logits.softmax(dim=-1)


def _draw_noise(
    num_draft: list[int],
    metadata: SamplingMetadata,
    default_generator: torch.Generator | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance uniforms ``[D]`` fp32 and the rows' token uniforms ``[N]`` fp64.

    One batched draw from ``default_generator``; then every request with its own generator
    redraws its values from it (``k_i`` acceptance uniforms, then ``k_i + 1`` row uniforms).
    """
    num_rows = sum(num_draft) + len(num_draft)
    uniform = torch.rand(sum(num_draft), generator=default_generator, device=device)
    row_uniform = torch.rand(num_rows, dtype=torch.float64, generator=default_generator,
                             device=device)
    if metadata.generators:
        row_starts = _cumsum_start(num_draft)
        for request, generator in metadata.generators.items():
            k = num_draft[request]
            row_start = row_starts[request]
            draft_start = row_start - request  # each earlier request has one non-draft row
            uniform[draft_start : draft_start + k] = torch.rand(
                k, generator=generator, device=device
            )
            row_uniform[row_start : row_start + k + 1] = torch.rand(
                k + 1, dtype=torch.float64, generator=generator, device=device
            )
    return uniform, row_uniform
