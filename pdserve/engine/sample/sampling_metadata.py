"""Per-step batched sampling inputs, built once from the sampling requests' parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams


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
    # grammar masks (structured outputs), set by the model runner after build()
    grammar_bitmask: torch.Tensor | None = None  # [R, ceil(V / 32)] int32
    grammar_rows: list[int] | None = None  # the R rows grammar_bitmask masks, in order

    @property
    def num_rows(self) -> int:
        """B, the number of sampling rows."""
        return self.temperature.shape[0]

    @property
    def needs_logit_processing(self) -> bool:
        """True when a grammar mask, bias, min_tokens or penalties change any row's logits."""
        return (
            self.grammar_bitmask is not None
            or self.penalties is not None
            or self.logit_bias_row_ids is not None
            or self.min_tokens_row_ids is not None
        )

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], generators: list[torch.Generator | None],
              eos_token_id: int | None, vocab_size: int,
              device: torch.device) -> SamplingMetadata:
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
        _check_shapes(len(params), vocab_size, prompt_token_ids=prompt_token_ids,
                      output_token_ids=output_token_ids, generators=generators)
        is_greedy = [p.is_greedy for p in params]
        temperature = [0.0 if g else p.temperature for p, g in zip(params, is_greedy)]
        top_k, top_p, min_p = _build_truncation(params, is_greedy, vocab_size, device)
        bias = _build_logit_bias(params, vocab_size, device)
        suppressed = _build_min_tokens(params, output_token_ids, eos_token_id, vocab_size, device)
        requested_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=_to_tensor(temperature, torch.float32, device),
            all_greedy=all(is_greedy), all_random=not any(is_greedy), vocab_size=vocab_size,
            top_k=top_k, top_p=top_p, min_p=min_p,
            generators={row: gen for row, (gen, greedy) in enumerate(zip(generators, is_greedy))
                        if gen is not None and not greedy},
            penalties=_build_penalties(params, prompt_token_ids, output_token_ids, vocab_size,
                                       device),
            logit_bias_row_ids=bias[0], logit_bias_token_ids=bias[1], logit_bias_values=bias[2],
            min_tokens_row_ids=suppressed[0], min_tokens_token_ids=suppressed[1],
            max_num_logprobs=max(requested_logprobs) if requested_logprobs else None,
        )


def _check_shapes(num_rows: int, vocab_size: int, **per_row: list) -> None:
    """Raises ValueError unless every ``per_row`` list has ``num_rows`` entries and the
    vocabulary is not empty."""
    for name, values in per_row.items():
        if len(values) != num_rows:
            raise ValueError(f"{name} has {len(values)} rows, params has {num_rows}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")


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
