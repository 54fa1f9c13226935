"""Chat messages with tools -> the messages and arguments ``apply_chat_template`` gets.

A template that renders tools itself (it uses a ``tools`` variable) gets them as
``tools=``, and tool calls / results in the Hugging Face message format. Any other template
gets the documented Hermes-style rendering (README, "Tool calling"):

- the tool list goes into the system message (one is added if the chat has none), with the
  instruction to answer a call as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``;
- an assistant turn's ``tool_calls`` become such blocks after its text;
- a ``tool`` turn's content is wrapped in ``<tool_response>...</tool_response>``.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.server.protocol_requests import ChatCompletionRequest
from pdserve.server.tools.parsers import TOOL_CALL_END, TOOL_CALL_START

TOOLS_SYSTEM_PROMPT = (
    "You can call functions. Their signatures are listed as JSON inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one JSON object per call, holding the function's name "
    "and its arguments, inside <tool_call></tool_call> tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>\n"
    "Only use the functions listed, and only the arguments they declare."
)


def template_renders_tools(chat_template: str | None) -> bool:
    """True when the chat template uses a ``tools`` variable (it renders tools itself)."""
    return bool(chat_template) and "tools" in chat_template


def _tool_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [tool.model_dump(mode="json", by_alias=True, exclude_none=True)
            for tool in req.tools or []]


def _call_block(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def render_messages(req: ChatCompletionRequest, chat_template: str | None
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The template's messages and extra keyword arguments for this request.

    Tools are shown to the model unless ``tool_choice`` is ``none``.

    Returns:
        ``(messages, kwargs)`` for ``tokenizer.apply_chat_template(messages, **kwargs)``.
    """
    show_tools = bool(req.tools) and req.tool_choice_name != "none"
    if template_renders_tools(chat_template):
        messages = []
        for m in req.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text}
            if m.tool_calls:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": c.arguments_object()}}
                    for c in m.tool_calls]
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            messages.append(msg)
        return messages, ({"tools": _tool_dicts(req)} if show_tools else {})

    messages = []
    for m in req.messages:
        content = m.text
        if m.tool_calls:
            blocks = [_call_block(c.function.name, c.arguments_object()) for c in m.tool_calls]
            content = "\n".join(([content] if content else []) + blocks)
        if m.role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        messages.append({"role": m.role, "content": content})
    if show_tools:
        tools_text = "\n".join(json.dumps(t, ensure_ascii=False) for t in _tool_dicts(req))
        instructions = TOOLS_SYSTEM_PROMPT.format(tools=tools_text)
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0] = {"role": messages[0]["role"],
                           "content": f"{messages[0]['content']}\n\n{instructions}"}
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    return messages, {}
