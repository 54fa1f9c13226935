"""Request sets for ``pdserve bench``: ``random``, ``mixed`` and ShareGPT-format files.

Prompt lengths are counted with the benchmark's tokenizer (by default the served model's);
they are what the dataset asked for. The lengths a run reports come from the server's
``usage`` (or, where a server sends none, from re-tokenizing), as in ``vllm bench serve``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

#: The seed's mixed load: 95 % short, 5 % long (prompt and output token ranges, inclusive).
MIXED_LONG_FRACTION = 0.05
MIXED_SHORT_PROMPT = (64, 256)
MIXED_SHORT_OUTPUT = (64, 128)
MIXED_LONG_PROMPT = (1500, 3000)
MIXED_LONG_OUTPUT = (64, 64)
#: ShareGPT conversations whose prompt or completion is shorter than this are skipped.
SHAREGPT_MIN_TOKENS = 4


@dataclass(frozen=True)
class SampleRequest:
    """One request of a benchmark.

    Attributes:
        prompt: the user message (chat) or the prompt text (completions).
        prompt_len: its length in tokens under the benchmark's tokenizer.
        expected_output_len: ``max_tokens`` to request.
    """

    prompt: str
    prompt_len: int
    expected_output_len: int


def _text_of_length(tokenizer, rng: random.Random, num_tokens: int) -> tuple[str, int]:
    """Text of about ``num_tokens`` tokens decoded from random token ids; returns the text
    and its exact re-tokenized length (decoding and encoding need not round-trip)."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(min(tokenizer.vocab_size, 49152)) if i not in special]
    ids = [rng.choice(vocab) for _ in range(num_tokens)]
    text = tokenizer.decode(ids)
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def random_requests(tokenizer, num_requests: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """Random-token prompts with lengths uniform in ``len * [1 - ratio, 1 + ratio]``.

    Raises:
        ValueError: a count or length < 1, or ``range_ratio`` outside [0, 1).
    """
    for name, value in (("num_requests", num_requests), ("random_input_len", input_len),
                        ("random_output_len", output_len)):
        _check_positive(name, value)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def draw(n: int) -> int:
        return rng.randint(max(1, int(n * (1 - range_ratio))), int(n * (1 + range_ratio)))

    out = []
    for _ in range(num_requests):
        text, num_tokens = _text_of_length(tokenizer, rng, draw(input_len))
        out.append(SampleRequest(text, num_tokens, draw(output_len)))
    return out


def mixed_requests(tokenizer, num_requests: int, seed: int = 0,
                   long_fraction: float = MIXED_LONG_FRACTION) -> list[SampleRequest]:
    """The seed's mix: short prompts of 64-256 tokens with 64-128 output tokens, and a
    ``long_fraction`` of long ones (1,500-3,000 prompt tokens, 64 output tokens).

    Exactly ``round(num_requests * long_fraction)`` requests are long, at random positions.

    Raises:
        ValueError: ``num_requests`` < 1 or ``long_fraction`` outside [0, 1].
    """
    _check_positive("num_requests", num_requests)
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    rng = random.Random(seed)
    is_long = set(rng.sample(range(num_requests), round(num_requests * long_fraction)))
    out = []
    for i in range(num_requests):
        prompt_range, output_range = ((MIXED_LONG_PROMPT, MIXED_LONG_OUTPUT) if i in is_long
                                      else (MIXED_SHORT_PROMPT, MIXED_SHORT_OUTPUT))
        text, num_tokens = _text_of_length(tokenizer, rng, rng.randint(*prompt_range))
        out.append(SampleRequest(text, num_tokens, rng.randint(*output_range)))
    return out


def sharegpt_requests(path: str | Path, tokenizer, num_requests: int,
                      output_len: int | None = None, seed: int = 0) -> list[SampleRequest]:
    """First human turn and first answer of ShareGPT conversations, shuffled by ``seed``.

    The file is a JSON list of ``{"conversations": [{"from": "human"|"gpt", "value": str},
    ...]}``. ``max_tokens`` is the answer's length unless ``output_len`` fixes it.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not that format, or holds fewer usable conversations than
            ``num_requests``.
    """
    _check_positive("num_requests", num_requests)
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    random.Random(seed).shuffle(data)
    out = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not turns or len(turns) < 2:
            continue
        prompt, answer = turns[0].get("value", ""), turns[1].get("value", "")
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        answer_len = len(tokenizer.encode(answer, add_special_tokens=False))
        if prompt_len < SHAREGPT_MIN_TOKENS or (output_len is None
                                                 and answer_len < SHAREGPT_MIN_TOKENS):
            continue
        out.append(SampleRequest(prompt, prompt_len, output_len or answer_len))
        if len(out) == num_requests:
            return out
    raise ValueError(f"{path}: only {len(out)} usable conversations, {num_requests} requested")
