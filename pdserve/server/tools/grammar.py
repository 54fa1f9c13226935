"""``tool_choice`` -> a grammar the output must follow.

``required`` / a named function: the output is one or more Hermes blocks (one when
``parallel_tool_calls`` is false or a function is named) and nothing else, each block's
arguments valid against its function's schema. ``auto``, when a function is ``strict`` or
``parallel_tool_calls`` is false: text, and from a ``<tool_call>`` on the same blocks (at
most one when ``parallel_tool_calls`` is false); otherwise ``auto`` is unconstrained, as in
vLLM. It is an xgrammar structural tag: a list of tags, one per allowed function, whose
begin string fixes the name and whose content is the arguments' JSON schema::

    <tool_call>\n{"name": "f", "arguments": <schema of f>}\n</tool_call>
"""

from __future__ import annotations

import json

from pdserve.engine.structured_output import (
    StructuredOutputKind,
    StructuredOutputParams,
    check_json_schema,
)
from pdserve.server.protocol_requests import ChatCompletionRequest
from pdserve.server.tools.parsers import TOOL_CALL_END, TOOL_CALL_START

#: Longest run of whitespace allowed inside call arguments (pretty-printed JSON fits; an
#: endless run of newlines, which small models fall into, does not).
MAX_WHITESPACE_RUN = 24


def tool_call_constraint(req: ChatCompletionRequest) -> StructuredOutputParams | None:
    """The grammar ``req.tool_choice`` asks for, or None (``none``; ``auto`` without a
    ``strict`` function and with parallel calls allowed).

    Raises:
        ValueError: a function's ``parameters`` is not a valid schema or uses a keyword that
            would not be enforced (the message names it), where the schema is enforced:
            every function under ``required``, the named one, ``strict`` ones under ``auto``.
    """
    choice = req.tool_choice_name
    functions = [tool.function for tool in req.tools or []]
    if choice == "named":
        functions = [f for f in functions if f.name == req.tool_choice.function.name]
    one_call = choice == "named" or not req.parallel_tool_calls
    if choice == "none" or (choice == "auto" and not (one_call or any(f.strict
                                                                     for f in functions))):
        return None
    tags = [{
        "type": "tag",
        "begin": f'{TOOL_CALL_START}\n{{"name": {json.dumps(f.name)}, "arguments": ',
        "content": {"type": "json_schema", "json_schema": _arguments_schema(f, choice),
                    "max_whitespace_cnt": MAX_WHITESPACE_RUN},
        "end": f"}}\n{TOOL_CALL_END}",
    } for f in functions]
    if choice == "auto":  # free text until a call starts
        fmt = {"type": "triggered_tags", "triggers": [TOOL_CALL_START], "tags": tags,
               "at_least_one": False, "stop_after_first": one_call}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
               "at_least_one": True, "stop_after_first": one_call}
    return StructuredOutputParams(StructuredOutputKind.STRUCTURAL_TAG,
                                  json.dumps({"type": "structural_tag", "format": fmt}))


def _arguments_schema(function, choice: str) -> dict:
    """The schema a call's arguments are held to: the function's own (a non-``strict``
    function under ``auto`` whose schema cannot be enforced: any JSON object)."""
    try:
        return check_json_schema(function.parameters_schema)
    except ValueError as exc:
        if choice == "auto" and not function.strict:
            return {"type": "object"}
        raise ValueError(f"function {function.name!r} parameters: {exc}") from None
