"""``tool_choice`` ``required`` / a named function -> a grammar the output must follow.

The output is one or more Hermes blocks (one when ``parallel_tool_calls`` is false or a
function is named) and nothing else, each block's arguments valid against its function's
schema. It is an xgrammar structural tag: a list of tags, one per allowed function, whose
begin string fixes the name and whose content is the arguments' JSON schema::

    <tool_call>\\n{"name": "f", "arguments": <schema of f>}\\n</tool_call>
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
    """The grammar ``req.tool_choice`` asks for, or None (``none`` / ``auto``).

    Raises:
        ValueError: a function's ``parameters`` is not a valid
            schema or uses a keyword that would not be enforced (the message names it).
    """
    choice = req.tool_choice_name
    if choice not in ("required", "named"):
        return None
    functions = [tool.function for tool in req.tools or []]
    if choice == "named":
        functions = [f for f in functions if f.name == req.tool_choice.function.name]
    tags = []
    for function in functions:
        try:
            schema = check_json_schema(function.parameters_schema)
        except ValueError as exc:
            raise ValueError(f"function {function.name!r} parameters: {exc}") from None
        tags.append({
            "type": "tag",
            "begin": f'{TOOL_CALL_START}\n{{"name": {json.dumps(function.name)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema,
                        "max_whitespace_cnt": MAX_WHITESPACE_RUN},
            "end": f"}}\n{TOOL_CALL_END}",
        })
    structural_tag = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": choice == "named" or not req.parallel_tool_calls,
        },
    }
    return StructuredOutputParams(StructuredOutputKind.STRUCTURAL_TAG, json.dumps(structural_tag))
