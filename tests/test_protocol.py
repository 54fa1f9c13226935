"""The OpenAI schema: request validation, conversion to SamplingParams, and response shapes
checked against the official ``openai`` client's own types and parsing."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from pdserve.engine.sampling_params import SamplingParams
from pdserve.server.protocol import (
    MAX_N,
    MIN_LOGPROB,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTopLogprob,
    ChatMessage,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    UsageInfo,
    error_body,
    validation_error_to_body,
)

DROP = object()  # marks a key to delete from the base body
USER_HI = [{"role": "user", "content": "hi"}]


def chat_body(**overrides) -> dict:
    body = {"model": "m", "messages": USER_HI}
    body.update(overrides)
    return {k: v for k, v in body.items() if v is not DROP}


def completion_body(**overrides) -> dict:
    body = {"model": "m", "prompt": "Once upon a time"}
    body.update(overrides)
    return {k: v for k, v in body.items() if v is not DROP}


def rejected_param(request_cls, body: dict) -> dict:
    with pytest.raises(ValidationError) as excinfo:
        request_cls.model_validate(body)
    return validation_error_to_body(excinfo.value)["error"]


# ------------------------------------------------------------------ bad requests

BAD_CHAT_BODIES = [
    ("max_tokens_zero", chat_body(max_tokens=0), "max_tokens"),
    ("max_tokens_negative", chat_body(max_tokens=-5), "max_tokens"),
    ("max_tokens_word", chat_body(max_tokens="ten"), "max_tokens"),
    ("max_tokens_bool", chat_body(max_tokens=True), "max_tokens"),
    ("max_tokens_fraction", chat_body(max_tokens=2.5), "max_tokens"),
    ("max_completion_tokens_zero", chat_body(max_completion_tokens=0), "max_completion_tokens"),
    ("temperature_negative", chat_body(temperature=-0.1), "temperature"),
    ("temperature_above_2", chat_body(temperature=2.5), "temperature"),
    ("temperature_word", chat_body(temperature="hot"), "temperature"),
    ("temperature_bool", chat_body(temperature=False), "temperature"),
    ("top_p_zero", chat_body(top_p=0), "top_p"),
    ("top_p_above_1", chat_body(top_p=1.5), "top_p"),
    ("top_k_below_minus_1", chat_body(top_k=-2), "top_k"),
    ("min_p_above_1", chat_body(min_p=1.5), "min_p"),
    ("n_zero", chat_body(n=0), "n"),
    ("n_above_max", chat_body(n=MAX_N + 1), "n"),
    ("messages_empty", chat_body(messages=[]), "messages"),
    ("messages_string", chat_body(messages="hi"), "messages"),
    ("messages_missing", chat_body(messages=DROP), "messages"),
    ("message_not_object", chat_body(messages=["hi"]), "messages.0"),
    ("role_unknown", chat_body(messages=[{"role": "bot", "content": "x"}]), "messages.0.role"),
    ("role_missing", chat_body(messages=[{"content": "x"}]), "messages.0.role"),
    ("content_int", chat_body(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
    ("content_object", chat_body(messages=[{"role": "user", "content": {"text": "x"}}]),
     "messages.0.content"),
    ("content_empty_parts", chat_body(messages=[{"role": "user", "content": []}]),
     "messages.0.content"),
    ("content_image_part",
     chat_body(messages=[{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     "messages.0.content"),
    ("content_part_text_not_str",
     chat_body(messages=[{"role": "system", "content": "s"},
                         {"role": "user", "content": [{"type": "text", "text": 3}]}]),
     "messages.1.content"),
    ("user_content_null", chat_body(messages=[{"role": "user", "content": None}]),
     "messages.0.content"),
    ("user_content_missing", chat_body(messages=[{"role": "user"}]), "messages.0.content"),
    ("top_logprobs_without_logprobs", chat_body(top_logprobs=3), "top_logprobs"),
    ("top_logprobs_with_logprobs_false", chat_body(logprobs=False, top_logprobs=0),
     "top_logprobs"),
    ("top_logprobs_above_20", chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("logprobs_not_bool", chat_body(logprobs="yes"), "logprobs"),
    ("logit_bias_word_key", chat_body(logit_bias={"abc": 1}), "logit_bias"),
    ("logit_bias_negative_key", chat_body(logit_bias={"-1": 1}), "logit_bias"),
    ("logit_bias_above_100", chat_body(logit_bias={"5": 150}), "logit_bias"),
    ("logit_bias_below_minus_100", chat_body(logit_bias={"5": -100.5}), "logit_bias"),
    ("logit_bias_value_word", chat_body(logit_bias={"5": "x"}), "logit_bias.5"),
    ("logit_bias_list", chat_body(logit_bias=[1, 2]), "logit_bias"),
    ("stop_empty_string", chat_body(stop=""), "stop"),
    ("stop_list_with_empty", chat_body(stop=["a", ""]), "stop"),
    ("stop_int_items", chat_body(stop=[1]), "stop"),
    ("stop_too_many", chat_body(stop=[f"s{i}" for i in range(17)]), "stop"),
    ("presence_penalty_above_2", chat_body(presence_penalty=3), "presence_penalty"),
    ("frequency_penalty_below_minus_2", chat_body(frequency_penalty=-2.5), "frequency_penalty"),
    ("repetition_penalty_zero", chat_body(repetition_penalty=0), "repetition_penalty"),
    ("seed_word", chat_body(seed="abc"), "seed"),
    ("seed_beyond_int64", chat_body(seed=2**64), "seed"),
    ("stream_not_bool", chat_body(stream="yes"), "stream"),
    ("stream_options_without_stream", chat_body(stream_options={"include_usage": True}),
     "stream_options"),
    ("include_usage_not_bool",
     chat_body(stream=True, stream_options={"include_usage": "x"}),
     "stream_options.include_usage"),
    ("min_tokens_negative", chat_body(min_tokens=-1), "min_tokens"),
    ("min_tokens_above_max_tokens", chat_body(max_tokens=4, min_tokens=5), "min_tokens"),
    ("min_tokens_above_max_completion_tokens",
     chat_body(max_tokens=100, max_completion_tokens=4, min_tokens=5), "min_tokens"),
    ("ignore_eos_not_bool", chat_body(ignore_eos=1), "ignore_eos"),
    ("model_not_str", chat_body(model=5), "model"),
]

BAD_COMPLETION_BODIES = [
    ("prompt_empty_string", completion_body(prompt=""), "prompt"),
    ("prompt_empty_list", completion_body(prompt=[]), "prompt"),
    ("prompt_list_with_empty_string", completion_body(prompt=["a", ""]), "prompt"),
    ("prompt_empty_token_list", completion_body(prompt=[[1, 2], []]), "prompt"),
    ("prompt_mixed_list", completion_body(prompt=[1, "a"]), "prompt"),
    ("prompt_negative_token", completion_body(prompt=[5, -1]), "prompt"),
    ("prompt_bool_token", completion_body(prompt=[True]), "prompt"),
    ("prompt_int", completion_body(prompt=5), "prompt"),
    ("prompt_missing", completion_body(prompt=DROP), "prompt"),
    ("logprobs_above_5", completion_body(logprobs=6), "logprobs"),
    ("logprobs_bool", completion_body(logprobs=True), "logprobs"),
    ("max_tokens_zero", completion_body(max_tokens=0), "max_tokens"),
    ("n_zero", completion_body(n=0), "n"),
    ("temperature_above_2", completion_body(temperature=3), "temperature"),
    ("min_tokens_above_default_max_tokens", completion_body(min_tokens=17), "min_tokens"),
]


@pytest.mark.parametrize("body,param", [(b, p) for _, b, p in BAD_CHAT_BODIES],
                         ids=[name for name, _, _ in BAD_CHAT_BODIES])
def test_bad_chat_request_is_rejected_naming_the_parameter(body, param):
    error = rejected_param(ChatCompletionRequest, body)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert f"'{param}'" in error["message"]


@pytest.mark.parametrize("body,param", [(b, p) for _, b, p in BAD_COMPLETION_BODIES],
                         ids=[name for name, _, _ in BAD_COMPLETION_BODIES])
def test_bad_completion_request_is_rejected_naming_the_parameter(body, param):
    error = rejected_param(CompletionRequest, body)
    assert error["param"] == param
    assert f"'{param}'" in error["message"]


@pytest.mark.parametrize("raw,param", [
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    ('{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', "top_p"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}', "max_tokens"),
])
def test_bad_json_value_is_rejected_naming_the_parameter(raw, param):
    with pytest.raises(ValidationError) as excinfo:
        ChatCompletionRequest.model_validate_json(raw)
    assert validation_error_to_body(excinfo.value)["error"]["param"] == param


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", '"hi"'])
def test_body_that_is_not_a_json_object_has_no_param(raw):
    with pytest.raises(ValidationError) as excinfo:
        ChatCompletionRequest.model_validate_json(raw)
    error = validation_error_to_body(excinfo.value)["error"]
    assert error["param"] is None
    assert error["type"] == "invalid_request_error"


def test_validator_message_is_kept_without_pydantic_prefix():
    error = rejected_param(ChatCompletionRequest, chat_body(stop=""))
    assert error["message"] == "Invalid value for 'stop': stop strings must not be empty"


def test_fastapi_body_prefix_is_dropped_from_param():
    class FakeRequestValidationError:
        def errors(self):
            return [{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"}]

    error = validation_error_to_body(FakeRequestValidationError())["error"]
    assert error["param"] == "messages"
    assert error["message"] == "Missing required parameter: 'messages'"


def test_error_body_has_openai_shape():
    assert error_body("boom", "server_error", code=500) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": 500}
    }


# ------------------------------------------------------------------ good requests

def test_string_content_parses():
    request = ChatCompletionRequest.model_validate(chat_body())
    assert request.text_messages() == [{"role": "user", "content": "hi"}]


def test_content_parts_are_joined_with_newlines():
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    request = ChatCompletionRequest.model_validate(chat_body(messages=messages))
    assert request.text_messages() == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42"},
    ]


def test_a_call_id_is_answered_once_per_call():
    """Two results for one call are refused (as OpenAI does); an id that a later assistant
    turn calls again (some clients reuse ids) may be answered again."""
    call = {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    result = {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    user = {"role": "user", "content": "hi"}
    ChatCompletionRequest.model_validate(chat_body(messages=[user, call, result, call,
                                                             result]))
    with pytest.raises(ValidationError, match="duplicate value for tool_call_id 'call_1'"):
        ChatCompletionRequest.model_validate(chat_body(messages=[user, call, result,
                                                                 result]))


@pytest.mark.parametrize("stop,expected", [
    (None, []), ("\n", ["\n"]), (["a", "bc"], ["a", "bc"]), ([], []),
    ([f"s{i}" for i in range(16)], [f"s{i}" for i in range(16)]),
])
def test_stop_list_accepts_string_or_list(stop, expected):
    assert ChatCompletionRequest.model_validate(chat_body(stop=stop)).stop_list == expected
    assert CompletionRequest.model_validate(completion_body(stop=stop)).stop_list == expected


def test_max_completion_tokens_wins_over_max_tokens():
    request = ChatCompletionRequest.model_validate(
        chat_body(max_tokens=100, max_completion_tokens=7))
    assert request.max_tokens_requested == 7
    assert request.to_sampling_params(default_max_tokens=500).max_tokens == 7


def test_unknown_fields_are_ignored():
    body = chat_body(response_format={"type": "text"}, foo="bar", parallel_tool_calls=False,
                     user="u", metadata={"k": "v"}, store=False, service_tier="auto")
    request = ChatCompletionRequest.model_validate(body)
    assert not hasattr(request, "foo")
    assert request.structured_output() is None
    CompletionRequest.model_validate(completion_body(suffix="", best_of=1, foo=[1]))


def test_null_means_default():
    body = chat_body(temperature=None, top_p=None, n=None, stream=None, logprobs=None,
                     presence_penalty=None, stop=None, seed=None, max_tokens=None)
    request = ChatCompletionRequest.model_validate(body)
    assert (request.temperature, request.top_p, request.n, request.stream) == (1.0, 1.0, 1, False)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "5"), ("n", "3"), ("temperature", "0.5"), ("seed", "1"), ("max_tokens", 5.0),
    ("top_logprobs", True),
])
def test_numbers_are_not_coerced_from_strings_floats_or_booleans(field, value):
    body = chat_body(**{field: value}, **({"logprobs": True} if field == "top_logprobs" else {}))
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate_json(json.dumps(body))
    assert validation_error_to_body(info.value)["error"]["param"] == field


def test_an_integer_is_a_valid_float():
    assert ChatCompletionRequest.model_validate(chat_body(temperature=1)).temperature == 1.0


def test_stream_options_include_usage_null_means_default():
    request = ChatCompletionRequest.model_validate(
        chat_body(stream=True, stream_options={"include_usage": None}))
    assert request.include_usage is False


@pytest.mark.parametrize("prompt,expected", [
    ("abc", ["abc"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_completion_prompt_forms(prompt, expected):
    assert CompletionRequest.model_validate(completion_body(prompt=prompt)).prompt_list == expected


def test_include_usage_only_when_streaming_with_the_option():
    plain = ChatCompletionRequest.model_validate(chat_body(stream=True))
    with_usage = ChatCompletionRequest.model_validate(
        chat_body(stream=True, stream_options={"include_usage": True}))
    assert (plain.include_usage, with_usage.include_usage) == (False, True)


# ------------------------------------------------------------------ to_sampling_params

CHAT_CONVERSIONS = [
    ("defaults_take_the_context_room", chat_body(), 100,
     SamplingParams(max_tokens=100)),
    ("no_room_given_means_no_cap", chat_body(), None,
     SamplingParams(max_tokens=None)),
    ("temperature_0_is_greedy", chat_body(temperature=0), 100,
     SamplingParams(temperature=0.0, max_tokens=100)),
    ("logprobs_false_is_none", chat_body(logprobs=False), 100,
     SamplingParams(max_tokens=100, logprobs=None)),
    ("logprobs_true_is_0", chat_body(logprobs=True), 100,
     SamplingParams(max_tokens=100, logprobs=0)),
    ("top_logprobs_is_k", chat_body(logprobs=True, top_logprobs=5), 100,
     SamplingParams(max_tokens=100, logprobs=5)),
    ("top_k_minus_1_is_off", chat_body(top_k=-1), 100,
     SamplingParams(top_k=0, max_tokens=100)),
    ("logit_bias_keys_become_ints",
     chat_body(logit_bias={"50256": -100, "7": 2.5}), 100,
     SamplingParams(logit_bias={50256: -100.0, 7: 2.5}, max_tokens=100)),
    ("empty_logit_bias_is_none", chat_body(logit_bias={}), 100,
     SamplingParams(max_tokens=100)),
    ("max_tokens_beats_room", chat_body(max_tokens=9), 100,
     SamplingParams(max_tokens=9)),
    ("every_field",
     chat_body(n=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1234,
               presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
               max_completion_tokens=32, min_tokens=4, ignore_eos=True, stop=["x"],
               stream=True, stream_options={"include_usage": True}, user="u"), 100,
     SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1234,
                    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                    max_tokens=32, min_tokens=4, ignore_eos=True)),
]

COMPLETION_CONVERSIONS = [
    ("default_max_tokens_is_16", completion_body(), 100, SamplingParams(max_tokens=16)),
    # null means the default, as everywhere (README): 16 on completions
    ("null_max_tokens_is_the_default_16", completion_body(max_tokens=None), 100,
     SamplingParams(max_tokens=16)),
    ("logprobs_int_is_k", completion_body(logprobs=2), 100,
     SamplingParams(max_tokens=16, logprobs=2)),
    ("logprobs_0_is_sampled_token_only", completion_body(logprobs=0), 100,
     SamplingParams(max_tokens=16, logprobs=0)),
    ("greedy_with_bias", completion_body(temperature=0, logit_bias={"3": 100}, max_tokens=5),
     100, SamplingParams(temperature=0.0, logit_bias={3: 100.0}, max_tokens=5)),
]


@pytest.mark.parametrize("body,room,expected", [c[1:] for c in CHAT_CONVERSIONS],
                         ids=[c[0] for c in CHAT_CONVERSIONS])
def test_chat_to_sampling_params(body, room, expected):
    params = ChatCompletionRequest.model_validate(body).to_sampling_params(room)
    assert params == expected


@pytest.mark.parametrize("body,room,expected", [c[1:] for c in COMPLETION_CONVERSIONS],
                         ids=[c[0] for c in COMPLETION_CONVERSIONS])
def test_completion_to_sampling_params(body, room, expected):
    params = CompletionRequest.model_validate(body).to_sampling_params(room)
    assert params == expected


def test_temperature_0_converts_to_a_greedy_engine_request():
    request = ChatCompletionRequest.model_validate(chat_body(temperature=0))
    assert request.to_sampling_params(10).is_greedy


def test_min_tokens_above_the_context_room_raises_value_error():
    request = ChatCompletionRequest.model_validate(chat_body(min_tokens=50))
    with pytest.raises(ValueError, match="min_tokens"):
        request.to_sampling_params(default_max_tokens=10)


# ------------------------------------------------------------------ responses vs openai types

def _chat_logprobs() -> ChatCompletionLogProbs:
    top = [ChatCompletionTopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105]),
           ChatCompletionTopLogprob(token="Yo", logprob=float("-inf"), bytes=[89, 111])]
    return ChatCompletionLogProbs(content=[
        ChatCompletionLogProb(token="Hi", logprob=-0.1, bytes=[72, 105], top_logprobs=top)])


def test_chat_completion_parses_as_openai_chat_completion():
    response = ChatCompletionResponse(
        model="m",
        choices=[ChatCompletionResponseChoice(
            index=0, message=ChatMessage(content="Hi"), logprobs=_chat_logprobs(),
            finish_reason="stop")],
        usage=UsageInfo(prompt_tokens=3, completion_tokens=1, total_tokens=4,
                        prompt_tokens_details=PromptTokensDetails(cached_tokens=2)),
    )
    parsed = ChatCompletion.model_validate(json.loads(response.model_dump_json()))
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == "Hi"
    assert parsed.choices[0].finish_reason == "stop"
    token = parsed.choices[0].logprobs.content[0]
    assert (token.token, token.logprob, token.bytes) == ("Hi", -0.1, [72, 105])
    assert token.top_logprobs[1].logprob == MIN_LOGPROB  # -inf is clamped, JSON stays valid
    assert parsed.usage.total_tokens == 4
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2


def test_chat_stream_chunks_parse_as_openai_chunks():
    chunks = [
        ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[
            ChatCompletionResponseStreamChoice(
                index=0, delta=DeltaMessage(role="assistant", content=""))]),
        ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[
            ChatCompletionResponseStreamChoice(
                index=0, delta=DeltaMessage(content="Hi"), logprobs=_chat_logprobs())]),
        ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[
            ChatCompletionResponseStreamChoice(
                index=0, delta=DeltaMessage(), finish_reason="length")]),
        ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[],
                                     usage=UsageInfo(prompt_tokens=3, completion_tokens=1,
                                                     total_tokens=4)),
    ]
    raw = [json.loads(chunk.model_dump_json()) for chunk in chunks]
    parsed = [ChatCompletionChunk.model_validate(r) for r in raw]
    assert raw[1]["usage"] is None and raw[1]["choices"][0]["delta"] == {"content": "Hi"}
    assert raw[2]["choices"][0]["delta"] == {}
    assert parsed[0].object == "chat.completion.chunk"
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[1].choices[0].delta.content == "Hi"
    assert parsed[1].choices[0].logprobs.content[0].token == "Hi"
    assert parsed[2].choices[0].finish_reason == "length"
    assert parsed[3].choices == [] and parsed[3].usage.completion_tokens == 1


def test_completion_parses_as_openai_completion():
    logprobs = CompletionLogProbs(text_offset=[0, 5], token_logprobs=[-0.5, -1.25],
                                  tokens=[" upon", " a"],
                                  top_logprobs=[{" upon": -0.5, " in": -2.0}, {" a": -1.25}])
    response = CompletionResponse(
        model="m",
        choices=[CompletionResponseChoice(index=0, text=" upon a", logprobs=logprobs,
                                          finish_reason="length")],
        usage=UsageInfo(prompt_tokens=4, completion_tokens=2, total_tokens=6),
    )
    parsed = Completion.model_validate(json.loads(response.model_dump_json()))
    assert parsed.id.startswith("cmpl-") and parsed.object == "text_completion"
    assert parsed.choices[0].text == " upon a"
    assert parsed.choices[0].logprobs.tokens == [" upon", " a"]
    assert parsed.choices[0].logprobs.top_logprobs[0] == {" upon": -0.5, " in": -2.0}
    assert parsed.usage.completion_tokens == 2


def test_completion_stream_chunk_parses_as_openai_completion():
    chunk = CompletionStreamResponse(model="m", choices=[
        CompletionResponseStreamChoice(index=1, text="!", finish_reason="stop")])
    raw = json.loads(chunk.model_dump_json())
    parsed = Completion.model_validate(raw)
    assert raw["usage"] is None
    assert (parsed.choices[0].index, parsed.choices[0].text) == (1, "!")


def test_model_card_parses_as_openai_model():
    card = ModelCard(id="smollm2", root="/models/smollm2", max_model_len=2048)
    parsed = Model.model_validate(json.loads(card.model_dump_json()))
    assert (parsed.id, parsed.object, parsed.owned_by) == ("smollm2", "model", "pdserve")
    assert parsed.model_extra["max_model_len"] == 2048


# ------------------------------------------------------------------ the real client end to end

def _sse(chunks) -> bytes:
    events = [f"data: {chunk.model_dump_json()}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
    return "".join(events).encode()


def _fake_server(request: httpx.Request) -> httpx.Response:
    """Stands in for the server: parses the client's request with our schema, answers."""
    if request.url.path == "/v1/models":
        listing = ModelList(data=[ModelCard(id="m", max_model_len=64)])
        return httpx.Response(200, json=listing.model_dump())
    body = json.loads(request.content)
    if request.url.path == "/v1/completions":
        completion = CompletionRequest.model_validate(body)
        answer = CompletionResponse(
            model="m",
            choices=[CompletionResponseChoice(index=0, text="x", finish_reason="length")],
            usage=UsageInfo(prompt_tokens=1, completion_tokens=completion.max_tokens,
                            total_tokens=1 + completion.max_tokens))
        return httpx.Response(200, json=json.loads(answer.model_dump_json()))
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        return httpx.Response(400, json=validation_error_to_body(exc))
    choice = ChatCompletionResponseStreamChoice
    chunks = [
        ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[
            choice(index=0, delta=DeltaMessage(role="assistant", content=""))]),
        ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[
            choice(index=0, delta=DeltaMessage(content=chat.text_messages()[-1]["content"]))]),
        ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[
            choice(index=0, delta=DeltaMessage(), finish_reason="stop")]),
    ]
    if chat.include_usage:
        chunks.append(ChatCompletionStreamResponse(
            id="chatcmpl-1", model="m", choices=[],
            usage=UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2)))
    return httpx.Response(200, content=_sse(chunks),
                          headers={"content-type": "text/event-stream"})


@pytest.fixture
def client():
    http_client = httpx.Client(transport=httpx.MockTransport(_fake_server))
    with openai.OpenAI(api_key="x", base_url="http://pdserve.test/v1",
                       http_client=http_client, max_retries=0) as c:
        yield c


def test_official_client_streams_a_chat_completion(client):
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "echo me"}], stream=True,
        stream_options={"include_usage": True}, max_completion_tokens=5, top_logprobs=None)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo me"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.total_tokens == 2


def test_official_client_gets_a_text_completion(client):
    completion = client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=3)
    assert completion.choices[0].text == "x" and completion.usage.completion_tokens == 3


def test_official_client_lists_models(client):
    models = list(client.models.list())
    assert [m.id for m in models] == ["m"] and models[0].model_extra["max_model_len"] == 64


def test_official_client_raises_bad_request_with_param(client):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], temperature=3)
    assert excinfo.value.param == "temperature"
    assert excinfo.value.type == "invalid_request_error"
