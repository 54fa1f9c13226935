"""Batched, vectorized next-token sampling: one row per request that samples this step.

NOTE: logprobs are always taken from ``log_softmax`` of the RAW model logits (fp32), before
logit bias, min_tokens suppression, penalties, temperature and truncation. They describe the
model's distribution, not the distribution a token was drawn from; speculative decoding relies
on this.

Processing order of the slow path (each step only when some row needs it)::

    raw logits [B, V] ──► logprobs = log_softmax(raw)                  (if any row asked)
        │
        ├─► + logit_bias ─► min_tokens (-inf on EOS / stop ids) ─► penalties
        │       (repetition over prompt+output, presence/frequency over output)
        │
        ├─► greedy rows:  argmax
        └─► random rows:  / temperature ─► min_p ─► top_k ─► top_p ─► softmax
                          ─► argmax(probs / q), q ~ Exp(1)   (exponential race)

The sampler never modifies the caller's logits tensor and does no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams


@dataclass
class PenaltyTensors:
    """Token histories and penalty values for the rows of one step.

    Token-id tensors are right-padded with ``vocab_size``: a pad id one past the vocabulary,
    so that a scatter into ``vocab_size + 1`` columns drops it with the last column.
    """

    prompt_token_ids: torch.Tensor  # [B, max_prompt_len] int64, padded with vocab_size
    output_token_ids: torch.Tensor  # [B, max_output_len] int64, padded with vocab_size
    presence_penalties: torch.Tensor  # [B] fp32, 0 = off
    frequency_penalties: torch.Tensor  # [B] fp32, 0 = off
    repetition_penalties: torch.Tensor  # [B] fp32, 1 = off


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one engine step, as device tensors.

    Built once per step by the model runner with :meth:`build`; ``B`` is the number of
    sampling rows and ``V`` the vocabulary size (the logits' last dimension).
    Optional fields are ``None`` when no row in the batch uses the feature, so the sampler
    skips that stage entirely.
    """

    temperature: torch.Tensor  # [B] fp32; greedy rows hold 0
    all_greedy: bool
    all_random: bool
    vocab_size: int
    top_k: torch.Tensor | None  # [B] int64, 0 = disabled for that row
    top_p: torch.Tensor | None  # [B] fp32, 1.0 = disabled for that row
    min_p: torch.Tensor | None  # [B] fp32, 0.0 = disabled for that row
    generators: dict[int, torch.Generator]  # row -> per-request generator (random rows only)
    penalties: PenaltyTensors | None
    logit_bias_row_ids: torch.Tensor | None  # [num_biases] int64
    logit_bias_token_ids: torch.Tensor | None  # [num_biases] int64
    logit_bias_values: torch.Tensor | None  # [num_biases] fp32
    min_tokens_row_ids: torch.Tensor | None  # [num_suppressed] int64
    min_tokens_token_ids: torch.Tensor | None  # [num_suppressed] int64
    max_num_logprobs: int | None  # K of the top-logprobs output; None if no row asked

    @property
    def num_rows(self) -> int:
        """B, the number of sampling rows."""
        return self.temperature.shape[0]

    @property
    def needs_logit_processing(self) -> bool:
        """True when bias, min_tokens suppression or penalties change any row's logits."""
        return (
            self.penalties is not None
            or self.logit_bias_row_ids is not None
            or self.min_tokens_row_ids is not None
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_id: int | None,
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Gathers per-request parameters into batched tensors on ``device``.

        Args:
            params: one ``SamplingParams`` per row.
            prompt_token_ids: each row's prompt tokens (for the repetition penalty).
            output_token_ids: each row's generated tokens so far (penalties, min_tokens).
            generators: each row's own generator (requests with a seed) or ``None``. It must
                live on ``device``. Greedy rows never draw noise, so theirs is not kept.
            eos_token_id: suppressed while a row has fewer than ``min_tokens`` outputs,
                unless that row sets ``ignore_eos``; ``None`` if the model has none.
            vocab_size: V, the width of the logits.
            device: where the logits live.

        Raises:
            ValueError: list lengths differ, or a ``logit_bias`` token id is >= vocab_size.
        """
        num_rows = len(params)
        for name, values in (
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
            ("generators", generators),
        ):
            if len(values) != num_rows:
                raise ValueError(f"{name} has {len(values)} rows, params has {num_rows}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")

        is_greedy = [p.is_greedy for p in params]
        temperature = [0.0 if g else p.temperature for p, g in zip(params, is_greedy)]
        top_k, top_p, min_p = _build_truncation(params, is_greedy, vocab_size, device)
        bias = _build_logit_bias(params, vocab_size, device)
        suppressed = _build_min_tokens(params, output_token_ids, eos_token_id, vocab_size, device)
        requested_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=_to_tensor(temperature, torch.float32, device),
            all_greedy=all(is_greedy),
            all_random=not any(is_greedy),
            vocab_size=vocab_size,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators={
                row: gen
                for row, (gen, greedy) in enumerate(zip(generators, is_greedy))
                if gen is not None and not greedy
            },
            penalties=_build_penalties(
                params, prompt_token_ids, output_token_ids, vocab_size, device
            ),
            logit_bias_row_ids=bias[0],
            logit_bias_token_ids=bias[1],
            logit_bias_values=bias[2],
            min_tokens_row_ids=suppressed[0],
            min_tokens_token_ids=suppressed[1],
            max_num_logprobs=max(requested_logprobs) if requested_logprobs else None,
        )


def _to_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _build_truncation(
    params: list[SamplingParams], is_greedy: list[bool], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``[B]`` top_k (int64), top_p and min_p (fp32) tensors, each ``None`` when unused.

    Greedy rows get the neutral values (0, 1.0, 0.0): argmax ignores truncation anyway.
    A top_k >= vocab_size keeps everything, so it is stored as 0 (disabled).
    """
    random_rows = [(row, p) for row, (p, g) in enumerate(zip(params, is_greedy)) if not g]
    top_k = [0] * len(params)
    top_p = [1.0] * len(params)
    min_p = [0.0] * len(params)
    for row, p in random_rows:
        top_k[row] = p.top_k if p.top_k < vocab_size else 0
        top_p[row] = p.top_p
        min_p[row] = p.min_p
    return (
        _to_tensor(top_k, torch.int64, device) if any(k > 0 for k in top_k) else None,
        _to_tensor(top_p, torch.float32, device) if any(x < 1.0 for x in top_p) else None,
        _to_tensor(min_p, torch.float32, device) if any(x > 0.0 for x in min_p) else None,
    )


def _pad_token_ids(token_ids: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Right-pads ragged token lists. Returns ``[len(token_ids), max_len]`` int64."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = [ids + [pad_id] * (max_len - len(ids)) for ids in token_ids]
    return _to_tensor(padded, torch.int64, device).view(len(token_ids), max_len)


def _build_penalties(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> PenaltyTensors | None:
    """Penalty tensors, or ``None`` when no row has a penalty.

    Rows without penalties get empty histories (all padding) so they cost no scatter work.
    """
    if not any(p.has_penalties for p in params):
        return None
    prompts = [ids if p.has_penalties else [] for p, ids in zip(params, prompt_token_ids)]
    outputs = [ids if p.has_penalties else [] for p, ids in zip(params, output_token_ids)]
    return PenaltyTensors(
        prompt_token_ids=_pad_token_ids(prompts, vocab_size, device),
        output_token_ids=_pad_token_ids(outputs, vocab_size, device),
        presence_penalties=_to_tensor([p.presence_penalty for p in params], torch.float32, device),
        frequency_penalties=_to_tensor(
            [p.frequency_penalty for p in params], torch.float32, device
        ),
        repetition_penalties=_to_tensor(
            [p.repetition_penalty for p in params], torch.float32, device
        ),
    )


def _build_logit_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Sparse ``[num_biases]`` (row ids, token ids, values); three ``None`` if there are none.

    Raises:
        ValueError: a ``logit_bias`` token id is outside the vocabulary.
    """
    entries = [
        (row, token_id, bias)
        for row, p in enumerate(params)
        for token_id, bias in (p.logit_bias or {}).items()
    ]
    for _, token_id, _ in entries:
        if token_id >= vocab_size:
            raise ValueError(
                f"logit_bias token id {token_id} is out of vocabulary (size {vocab_size})"
            )
    if not entries:
        return None, None, None
    row_ids, token_ids, values = zip(*entries)
    return (
        _to_tensor(list(row_ids), torch.int64, device),
        _to_tensor(list(token_ids), torch.int64, device),
        _to_tensor(list(values), torch.float32, device),
    )


def _build_min_tokens(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_id: int | None,
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Sparse ``[num_suppressed]`` (row ids, token ids) to set to -inf below ``min_tokens``.

    Suppressed: the row's ``stop_token_ids`` and, unless ``ignore_eos``, ``eos_token_id``.
    Ids >= vocab_size can never be sampled, so they need no suppression and are skipped.
    """
    entries: list[tuple[int, int]] = []
    for row, (p, outputs) in enumerate(zip(params, output_token_ids)):
        if len(outputs) >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids)
        if eos_token_id is not None and not p.ignore_eos:
            stop_ids.add(eos_token_id)
        entries.extend((row, t) for t in sorted(stop_ids) if t < vocab_size)
    if not entries:
        return None, None
    row_ids, token_ids = zip(*entries)
    return (
        _to_tensor(list(row_ids), torch.int64, device),
        _to_tensor(list(token_ids), torch.int64, device),
    )


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


@dataclass
class LogprobsTensors:
    """Logprobs of the model's raw distribution (see the module NOTE)."""

    sampled_logprobs: torch.Tensor  # [B] fp32, logprob of the sampled token
    sampled_ranks: torch.Tensor  # [B] int64, 1 + number of tokens strictly more likely
    top_token_ids: torch.Tensor  # [B, K] int64, most likely first (K may be 0)
    top_logprobs: torch.Tensor  # [B, K] fp32, descending


@dataclass
class SamplerOutput:
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
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1), logprobs=None)

        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V] fp32

        logits = self._process_logits(logits.to(torch.float32, copy=True), metadata)
        if metadata.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample_random(logits, metadata, default_generator)
            if not metadata.all_random:
                is_greedy = metadata.temperature <= GREEDY_TEMPERATURE
                sampled = torch.where(is_greedy, logits.argmax(dim=-1), sampled)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = self._gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
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
        """Logit bias, then min_tokens suppression, then penalties. ``[B, V]`` fp32 in and out."""
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
            logits = apply_penalties(
                logits,
                p.prompt_token_ids,
                p.output_token_ids,
                p.presence_penalties,
                p.frequency_penalties,
                p.repetition_penalties,
            )
        return logits

    @staticmethod
    def _sample_random(
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        default_generator: torch.Generator | None,
    ) -> torch.Tensor:
        """Temperature, min_p, top_k, top_p, then the exponential race. Returns ``[B]`` int64.

        ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. picks token ``i`` with probability
        ``probs[i]``, so sampling is one vectorized op with no host sync. Greedy rows in a
        mixed batch are computed too (with temperature 1) and overwritten by the caller.
        """
        is_greedy = metadata.temperature <= GREEDY_TEMPERATURE
        temperature = torch.where(is_greedy, 1.0, metadata.temperature)
        logits = logits / temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)  # [B, V] fp32

        noise = torch.empty_like(probs).exponential_(generator=default_generator)
        # A seeded row draws its own [V] noise, so its tokens do not depend on the batch.
        for row, generator in metadata.generators.items():
            noise[row].exponential_(generator=generator)
        # Exp(1) can round to 0; a zero would turn masked tokens' 0/0 into NaN.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return probs.div_(noise).argmax(dim=-1)

    @staticmethod
    def _gather_logprobs(
        raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_top: int
    ) -> LogprobsTensors:
        """Logprobs of the sampled ``[B]`` tokens and the ``num_top`` best, from ``[B, V]`` fp32."""
        sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
        ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1
        top_logprobs, top_token_ids = raw_logprobs.topk(num_top, dim=-1)
        return LogprobsTensors(
            sampled_logprobs=sampled_logprobs.squeeze(1),
            sampled_ranks=ranks,
            top_token_ids=top_token_ids,
            top_logprobs=top_logprobs,
        )
