"""Streaming text for one request: token ids to UTF-8-safe text deltas, and OpenAI stop strings.

Two small state machines, one per request, used one after the other::

    token ids --IncrementalDetokenizer.add_tokens--> text delta
              --StopStringMatcher.process--------> (text safe to send, stopped)

Neither touches the engine; both only see the tokenizer's ``decode`` and plain strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

#: Character a lossy UTF-8 decode puts where bytes do not (yet) form a character.
REPLACEMENT_CHAR = "\ufffd"

#: Prompt tokens decoded ahead of the first generated token, so that its text is
#: measured in context (SentencePiece decoders drop the leading space of the first
#: token of a sequence; byte-level BPE decoders do not).
NUM_PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,
        clean_up_tokenization_spaces: bool | None = ...,
    ) -> str:
        """The text of ``token_ids``; an incomplete UTF-8 sequence decodes to U+FFFD."""
        ...


class IncrementalDetokenizer:
    """Turns one request's stream of generated token ids into text deltas.

    NOTE: the invariant. The detokenizer keeps a window ``ids[prefix:]`` of token
    ids and a read offset inside it::

        ids:  | prompt context, earlier text | text sent last step | held back (pending) |
                                               ^ prefix              ^ read                ^ end

    Each step decodes ``ids[prefix:read]`` (text already sent) and ``ids[prefix:]``
    and sends the difference, but only when the latter does not end in U+FFFD,
    which is what a lossy decode shows for a character whose bytes are split over
    tokens (byte-level BPE splits emoji and CJK that way), and adds text. Then
    ``prefix`` moves to ``read`` and ``read`` to the end. A step costs two decodes
    of the window (the last step's ids plus the held-back ids), not of the whole
    sequence; the ids list itself grows by one int per token.

    Guarantees, for ``gen`` the ids passed to ``add_tokens`` (all calls together):

    - No delta ends in an incomplete character: U+FFFD is sent only where it is in
      the decoded text for good (bytes that no later token completed).
    - ``text`` after ``flush()`` equals
      ``decode(ctx + gen)`` with the prefix ``decode(ctx)`` removed, where ``ctx`` is the last
      ``NUM_PROMPT_CONTEXT_TOKENS`` prompt ids and decoding uses
      ``skip_special_tokens`` and ``clean_up_tokenization_spaces=False``: the text
      the generated ids add after the prompt. For byte-level BPE tokenizers
      (GPT-2 style, e.g. SmolLM2, Llama 3, Qwen) this is exactly
      ``tokenizer.decode(gen, skip_special_tokens=...)``, the first token's leading
      space included. For SentencePiece tokenizers it is the same except that the
      first token's leading space is kept (``decode(gen)`` alone would strip it).
      If the prompt context ends inside a character, no context is used, and the
      result is ``decode(gen)`` for every tokenizer.
    - Ids are held back only while the window's decode ends in U+FFFD or they add
      no text yet (skipped special tokens); ``flush`` sends what is held as decoded,
      U+FFFD included.
    - Several ids per ``add_tokens`` call give the same deltas, joined, as one id
      per call.

    Tokenizers whose ``decode`` rewrites text across token boundaries
    (``clean_up_tokenization_spaces=True``) are decoded without that clean-up.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The prompt's last few ids, then every generated id; only ids[prefix:] is decoded.
        self._ids: list[int] = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        if self._decode(self._ids).endswith(REPLACEMENT_CHAR):
            self._ids = []  # the prompt ends mid-character: no context rather than a broken one
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pieces: list[str] = []
        self.num_generated_tokens = 0

    @property
    def text(self) -> str:
        """All text sent so far (every delta returned by ``add_tokens`` and ``flush``)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def has_pending(self) -> bool:
        """True while some generated ids have not produced text yet (a character not yet
        complete, or skipped special tokens that the next text will be measured after)."""
        return self._read_offset < len(self._ids)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the new text they complete (may be "").

        Several ids at once (speculative decoding) give the same text as one at a time.
        """
        deltas = []
        for token_id in token_ids:
            self._ids.append(token_id)
            self.num_generated_tokens += 1
            deltas.append(self._step(is_final=False))
        return self._emit("".join(deltas))

    def flush(self) -> str:
        """At the end of the request, return the held-back text, even if it is not valid UTF-8."""
        return self._emit(self._step(is_final=True))

    def _step(self, is_final: bool) -> str:
        """Send ``ids[prefix:]`` minus ``ids[prefix:read]`` if complete (or ``is_final``)."""
        if not self.has_pending:
            return ""
        sent_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if not is_final:
            if window_text.endswith(REPLACEMENT_CHAR) or len(window_text) <= len(sent_text):
                return ""  # incomplete character, or ids that add no text yet: keep waiting
        # The window's text extends the text already sent; see the class invariant.
        delta = window_text[len(sent_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta


class StopStringMatcher:
    """OpenAI ``stop`` strings over one request's streamed text.

    Feed every text delta to ``process``; it returns the text that is safe to send
    now. A suffix of the text seen so far that is the beginning of some stop
    string (at most ``max(len(s)) - 1`` characters) is held back until the next
    delta shows whether the stop string follows.

    Guarantees:

    - The text sent (all ``process`` results, then ``flush``) is the text fed, cut
      just before the first stop string; the stop string and everything after it
      are never sent (OpenAI trims the stop string).
    - "First" is the occurrence that ends first in the text, which is what a
      token-by-token check sees first; of two ending at the same place, the longer
      (earlier-starting) one. So the result does not depend on how the text was
      split into deltas, even when a stop string spans several deltas.
    - With no stop strings, text passes straight through and nothing is held.
    - After a stop, ``process`` returns ``("", True)`` and ``flush`` returns "".
    - ``include_stop`` (vLLM's ``include_stop_str_in_output``) sends the stop string too.
    - ``min_tokens`` (vLLM's rule): while the output has fewer tokens (``process``'s
      ``num_tokens``), no stop string ends it, nor can a later match end inside that text.

    Args:
        stop: the stop strings.
        include_stop: end the text after the stop string instead of before it.
        min_tokens: output tokens before a stop string may end the text.

    Raises:
        TypeError: ``stop`` is a single string, or an entry is not a string.
        ValueError: ``stop`` has an empty string (it would match everywhere).
    """

    def __init__(self, stop: Sequence[str], include_stop: bool = False,
                 min_tokens: int = 0) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a list of strings, not a single string")
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop entries must be strings, got {type(s).__name__}")
            if not s:
                raise ValueError("stop must not contain an empty string")
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(stop))  # de-duplicated, order kept
        self.max_held_chars = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""
        self.matched_stop: str | None = None  # the stop string that ended the text, if any
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self._min_end = 0  # a match in the next text must end after this index

    @property
    def is_stopped(self) -> bool:
        """True once a stop string has been seen."""
        return self.matched_stop is not None

    def process(self, new_text: str, num_tokens: int | None = None) -> tuple[str, bool]:
        """Return ``(text safe to send now, stopped)`` after appending ``new_text``, with
        which the output holds ``num_tokens`` tokens (None: at least ``min_tokens``)."""
        if self.is_stopped:
            return "", True
        if not self.stop:
            return new_text, False
        text = self._held + new_text
        active = num_tokens is None or num_tokens >= self.min_tokens
        match = self._first_match(text, self._min_end) if active else None
        if match is not None:
            start, self.matched_stop = match
            self._held = ""
            return text[:start + len(self.matched_stop) * self.include_stop], True
        num_held = self._num_chars_to_hold(text)
        self._held = text[len(text) - num_held :]
        self._min_end = 0 if active else num_held
        return text[: len(text) - num_held], False

    def flush(self) -> str:
        """At the normal end of the request, return the held-back text."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str, min_end: int) -> tuple[int, str] | None:
        """``(start, stop string)`` of the occurrence ending first after ``min_end``,
        longest on a tie."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            start = text.find(s, max(0, min_end - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        return None if best is None else (best[1], best[2])

    def _num_chars_to_hold(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for n in range(min(self.max_held_chars, len(text)), 0, -1):
            tail = text[len(text) - n :]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
