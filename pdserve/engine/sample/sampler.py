"""Batched, vectorized next-token sampling: one row per request that samples this step.

NOTE: logprobs are always taken from ``log_softmax`` of the RAW model logits (fp32), before
logit bias, min_tokens suppression, penalties, temperature and truncation. They describe the
model's distribution, not the distribution a token was drawn from; speculative decoding relies
on this.

Processing order of the slow path (each step only when some row needs it)::

    raw logits [B, V] ──► logprobs = log_softmax(raw)                  (if any row asked)
        │
        ├─► grammar mask (-inf) ─► + logit_bias ─► min_tokens (-inf on EOS / stop ids)
        │       ─► penalties
        │       (repetition over prompt+output, presence/frequency over output)
        │
        ├─► greedy rows:  argmax
        └─► random rows:  / temperature ─► min_p ─► top_k ─► top_p ─► softmax
                          ─► inverse transform: one uniform u per row, the first
                             token whose cumulative probability exceeds u (draws.py)

The sampler never modifies the caller's logits tensor and does no host sync, except in
top-k/top-p (which rows its candidate cut settles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.sample.logits_processors import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)
from pdserve.engine.sample.draws import draw_uniforms, greedy_tokens, sample_rows
from pdserve.engine.sample.logprobs import LogprobsTensors, gather_logprobs
from pdserve.engine.sample.sampling_metadata import SamplingMetadata
from pdserve.engine.sampling_params import GREEDY_TEMPERATURE
from pdserve.engine.structured_output.backend import apply_token_bitmask


@dataclass
class SamplerOutput:
    """One token per row, plus the raw distribution's logprobs when a row asked."""

    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    """Picks one token per row of a ``[B, V]`` logits tensor; see the module docstring."""

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        default_generator: torch.Generator | None = None,
    ) -> SamplerOutput:
        """Samples the next token of every row.

        Args:
            logits: ``[B, V]`` raw model logits, any float dtype; never modified.
            metadata: built by :meth:`SamplingMetadata.build` for these ``B`` rows.
            default_generator: noise source for random rows without their own generator
                (one batched draw); ``None`` uses torch's global RNG.

        Returns:
            ``SamplerOutput`` with ``[B]`` int64 token ids and, if any row asked, logprobs of
            the RAW logits (before bias, penalties, temperature and truncation).

        Raises:
            ValueError: logits are not a 2-D float tensor matching ``metadata``'s shape.
        """
        self._check_logits(logits, metadata)
        if (
            metadata.all_greedy
            and not metadata.needs_logit_processing
            and metadata.max_num_logprobs is None
        ):
            return SamplerOutput(sampled_token_ids=greedy_tokens(logits), logprobs=None)

        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V] fp32

        logits = self._process_logits(logits.to(torch.float32, copy=True), metadata)
        if metadata.all_greedy:
            sampled = greedy_tokens(logits)
        else:
            sampled = self._sample_random(logits, metadata, default_generator)
            if not metadata.all_random:
                is_greedy = metadata.temperature <= GREEDY_TEMPERATURE
                sampled = torch.where(is_greedy, greedy_tokens(logits), sampled)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _check_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [B, V], got shape {tuple(logits.shape)}")
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
        if logits.shape[0] != metadata.num_rows:
            raise ValueError(
                f"logits have {logits.shape[0]} rows, metadata has {metadata.num_rows}"
            )
        if logits.shape[1] != metadata.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns, metadata vocab_size is "
                f"{metadata.vocab_size}"
            )

    @staticmethod
    def _process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Grammar mask, logit bias, min_tokens, then penalties. ``[B, V]`` fp32 in and out."""
        if metadata.grammar_bitmask is not None:
            apply_token_bitmask(logits, metadata.grammar_bitmask, metadata.grammar_rows)
        if metadata.logit_bias_row_ids is not None:
            logits.index_put_(
                (metadata.logit_bias_row_ids, metadata.logit_bias_token_ids),
                metadata.logit_bias_values,
                accumulate=True,
            )
        if metadata.min_tokens_row_ids is not None:
            logits[metadata.min_tokens_row_ids, metadata.min_tokens_token_ids] = float("-inf")
        if metadata.penalties is not None:
            p = metadata.penalties
            logits = apply_penalties(logits, p.prompt_token_ids, p.output_token_ids,
                                     p.presence_penalties, p.frequency_penalties,
                                     p.repetition_penalties)
        return logits

    @staticmethod
    def _sample_random(
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        default_generator: torch.Generator | None,
    ) -> torch.Tensor:
        """Temperature, min_p, top_k, top_p, then one token per row by inverse transform
        sampling (:func:`~pdserve.engine.sample.draws.sample_rows`, one uniform per row; no
        host sync but top-k/top-p's). Returns ``[B]`` int64. Greedy rows in a mixed batch are computed too
        (with temperature 1) and overwritten by the caller.
        """
        is_greedy = metadata.temperature <= GREEDY_TEMPERATURE
        temperature = torch.where(is_greedy, 1.0, metadata.temperature)
        logits = logits / temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)  # [B, V] fp32

        # A seeded row draws its own uniform, so its tokens do not depend on the batch.
        uniforms = draw_uniforms(probs.shape[0], metadata.generators, default_generator,
                                 probs.device)
        return sample_rows(probs, uniforms)

