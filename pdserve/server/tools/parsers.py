"""Tool-call parsers: a model family's text format -> OpenAI ``tool_calls``.

A parser splits finished text into content and calls (:meth:`ToolCallParser.parse`) and,
while streaming, turns text deltas into content deltas and tool-call deltas
(:meth:`ToolCallParser.stream`) the way OpenAI streams them: a call's id and name first,
then its arguments in pieces. Both paths give a call the same arguments text, so streamed
deltas reassemble to the non-streamed call. Parsers are registered by name.

Hermes format (NousResearch Hermes 2 Pro; Qwen2.5 and SmolLM-family templates use it)::

    optional text
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block that does not parse as JSON (the output was cut by ``max_tokens``, or the model
wrote invalid JSON) is still a call once its head ``{"name": "...", "arguments":`` is
complete: its arguments are the text as far as it got, as OpenAI returns a call cut by
``length``; it counts as a parse failure. A cut block whose head never completed is
dropped; a closed block that is not a call stays text. A cut block whose call is complete
but whose end tag was cut (``}}\n</tool_``) is a whole call, and a start tag cut at the very
end of the output (``<tool``) is dropped, not sent as content. Streamed and non-streamed
outputs follow the same rules.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

#: The head of a Hermes call up to where its arguments start.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def new_call_id() -> str:
    """A fresh tool-call id (``call_`` + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedToolCall:
    """One call: function name and arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass
class ParseResult:
    """Finished text split: ``content`` (None when only calls) and the calls in order."""

    content: str | None
    tool_calls: list[ParsedToolCall]
    num_failed: int = 0  # call blocks that did not parse (left in content)


@dataclass
class ToolCallDelta:
    """A streamed piece of call ``index``: id and name on its first delta, then arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class StreamDelta:
    """What one text delta turned into: content text and/or tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStream(Protocol):
    """Streaming parser of one choice: text deltas in, content and tool-call deltas out."""

    def feed(self, text: str) -> StreamDelta:
        """Consumes the next text delta."""

    def finish(self) -> StreamDelta:
        """Flushes what is held back at the end of the output."""

    @property
    def num_calls(self) -> int:
        """Calls started so far."""

    @property
    def num_failed(self) -> int:
        """Call blocks that did not parse."""


class ToolCallParser(Protocol):
    """A model family's tool-call format, registered under ``name``."""

    name: str

    def parse(self, text: str) -> ParseResult:
        """Splits a finished output into content and tool calls."""

    def stream(self) -> ToolCallStream:
        """A fresh streaming parser for one choice."""


def _raw_arguments(body: str, head_end: int, closed: bool) -> str:
    """The arguments text of a block that did not parse: from the end of its head to where
    the output was cut, or (a closed block) up to its outer closing brace."""
    if not closed:
        return body[head_end:]
    raw = body[head_end:].rstrip()
    if raw.endswith("}"):
        raw = raw[:-1].rstrip()
    return raw


def _split_call(body: str) -> tuple[str, str] | None:
    """(name, arguments text) of one call body, or None if it is not a valid call.

    The arguments text is the model's own (so streamed pieces add up to it) when the body
    reads ``{"name": ..., "arguments": ...}`` in that order; otherwise it is re-serialized.
    """
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    head = _CALL_HEAD.match(body)
    if head is not None:
        raw = body[head.end():].rstrip()
        if raw.endswith("}"):
            raw = raw[:-1].rstrip()
            try:
                if json.loads(raw) == args:
                    return obj["name"], raw
            except json.JSONDecodeError:
                pass
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    name = "hermes"

    def parse(self, text: str) -> ParseResult:
        """Splits a finished output into content and calls (see the module docstring for
        blocks that do not parse)."""
        calls: list[ParsedToolCall] = []
        content_parts: list[str] = []
        num_failed = 0
        pos = 0
        while True:
            start = text.find(TOOL_CALL_START, pos)
            if start < 0:
                content_parts.append(_without_cut_tag(text[pos:], TOOL_CALL_START))
                break
            end = text.find(TOOL_CALL_END, start)
            body_end = len(text) if end < 0 else end
            body = text[start + len(TOOL_CALL_START):body_end]
            if end < 0:
                body = _complete_cut_call(body)
            parsed = _split_call(body)
            block_end = len(text) if end < 0 else end + len(TOOL_CALL_END)
            head = _CALL_HEAD.match(body) if parsed is None else None
            if parsed is not None:
                content_parts.append(text[pos:start].rstrip())
                calls.append(ParsedToolCall(*parsed))
            elif head is not None:  # a call that did not parse: arguments as they got
                num_failed += 1
                content_parts.append(text[pos:start].rstrip())
                calls.append(ParsedToolCall(json.loads(f'"{head.group(1)}"'),
                                            _raw_arguments(body, head.end(), end >= 0)))
            elif end < 0:  # cut before its name was complete: dropped
                num_failed += 1
                content_parts.append(text[pos:start].rstrip())
            else:  # a closed block that is not a call: text
                num_failed += 1
                content_parts.append(text[pos:block_end])
            pos = block_end
            if end < 0:
                break
        content = "".join(content_parts).strip()
        return ParseResult(content or None, calls, num_failed)

    def stream(self) -> HermesToolStream:
        """A fresh streaming parser for one choice."""
        return HermesToolStream()


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _without_cut_tag(text: str, marker: str) -> str:
    """``text`` (the end of an output) less a start of ``marker`` cut at its very end."""
    stripped = text.rstrip()
    cut = _held_back(stripped, marker)
    return stripped[:len(stripped) - cut] if cut else text


def _complete_cut_call(body: str) -> str:
    """A block cut before its end tag: the body without the cut end tag (``}\n</tool_``)
    when what precedes it is a whole call, else the body as it is."""
    trimmed = _without_cut_tag(body, TOOL_CALL_END)
    return trimmed if trimmed is not body and _split_call(trimmed) is not None else body


class HermesToolStream:
    """Streaming side of :class:`HermesToolParser`; see the module docstring."""

    def __init__(self) -> None:
        self._buffer = ""  # text not yet turned into deltas
        self._in_call = False
        self._call_index = -1
        self._args_start: int | None = None  # where arguments begin in _buffer
        self._num_args_sent = 0
        self._num_failed = 0

    @property
    def num_calls(self) -> int:
        """Calls started so far (a call starts once its name is known)."""
        return self._call_index + 1

    @property
    def num_failed(self) -> int:
        """Call blocks that did not parse."""
        return self._num_failed

    def feed(self, text: str) -> StreamDelta:
        """Consumes the next text delta. Text whose meaning a later delta may change (a
        partial tag, trailing whitespace, a call's closing brace) is held back."""
        self._buffer += text
        out = StreamDelta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> StreamDelta:
        """Flushes what is held back at the end of the output: a call the output cut off
        keeps the arguments it got, or is dropped if its name is incomplete."""
        out = StreamDelta()
        while self._step(out, final=True):
            pass
        if self._in_call:  # output ended inside a call (no end tag)
            self._close_call(out, _complete_cut_call(self._buffer), closed=False)
        elif self._buffer:
            out.content += _without_cut_tag(self._buffer, TOOL_CALL_START).rstrip()
        self._buffer = ""
        return out

    def _step(self, out: StreamDelta, final: bool) -> bool:
        """Turns as much of the buffer as is safe into deltas; True to go again."""
        if not self._in_call:
            start = self._buffer.find(TOOL_CALL_START)
            if start < 0:
                # hold back a possible tag start, and trailing whitespace (sent only once
                # text follows it, so the whitespace around calls never streams as content)
                keep = 0
                if not final:
                    keep = _held_back(self._buffer, TOOL_CALL_START)
                    before = self._buffer[:len(self._buffer) - keep]
                    keep += len(before) - len(before.rstrip())
                    out.content += self._buffer[:len(self._buffer) - keep]
                else:  # the end of the output: trailing whitespace is not content
                    out.content += _without_cut_tag(self._buffer, TOOL_CALL_START).rstrip()
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return False
            out.content += self._buffer[:start].rstrip()
            self._buffer = self._buffer[start + len(TOOL_CALL_START):]
            self._in_call, self._args_start, self._num_args_sent = True, None, 0
            return True
        end = self._buffer.find(TOOL_CALL_END)
        if end >= 0:
            self._close_call(out, self._buffer[:end], closed=True)
            self._buffer = self._buffer[end + len(TOOL_CALL_END):]
            return True
        if self._args_start is None:
            head = _CALL_HEAD.match(self._buffer)
            if head is None or head.end() == len(self._buffer):  # its \s* may grow yet
                return False
            self._start_call(out, head)
        # arguments so far, minus a tail that may be the call's closing brace and end tag
        args = self._buffer[self._args_start:]
        last_brace = args.rfind("}")
        safe = len(args) if last_brace < 0 else last_brace
        safe = len(args[:safe].rstrip()) if last_brace >= 0 else safe
        if safe > self._num_args_sent:
            self._emit(out, args[self._num_args_sent:safe])
            self._num_args_sent = safe
        return False

    def _start_call(self, out: StreamDelta, head: re.Match) -> None:
        self._call_index += 1
        self._args_start = head.end()
        out.tool_calls.append(ToolCallDelta(self._call_index, "", new_call_id(),
                                            json.loads(f'"{head.group(1)}"')))

    def _emit(self, out: StreamDelta, arguments: str) -> None:
        """Arguments of the current call; merged into this delta's entry for the call."""
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last.index == self._call_index:
            last.arguments += arguments
        else:
            out.tool_calls.append(ToolCallDelta(self._call_index, arguments))

    def _close_call(self, out: StreamDelta, body: str, closed: bool) -> None:
        parsed = _split_call(body)
        self._in_call = False
        if parsed is None:
            self._num_failed += 1
            if self._args_start is None:
                head = _CALL_HEAD.match(body)
                if head is not None:  # its head completed at the very end
                    self._start_call(out, head)
                elif closed:  # nothing of it was sent as a call: it is text
                    out.content += TOOL_CALL_START + body + TOOL_CALL_END
                    return
                else:  # cut before its name was complete: dropped
                    return
            raw = _raw_arguments(body, self._args_start, closed)
            if len(raw) > self._num_args_sent:
                self._emit(out, raw[self._num_args_sent:])
            return
        name, arguments = parsed
        if self._args_start is None:  # head never matched: send the call whole
            self._call_index += 1
            out.tool_calls.append(ToolCallDelta(self._call_index, arguments, new_call_id(),
                                                name))
            return
        if arguments.startswith(self._buffer[self._args_start:][:self._num_args_sent]) \
                and len(arguments) > self._num_args_sent:
            self._emit(out, arguments[self._num_args_sent:])


#: Tool-call parsers by name.
TOOL_PARSERS: dict[str, type] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> ToolCallParser:
    """The registered parser ``name``.

    Raises:
        ValueError: no parser has that name.
    """
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(TOOL_PARSERS)}") \
            from None
