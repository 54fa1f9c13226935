"""What a request's output must match: the engine type every API form converts to."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass


class StructuredOutputKind(str, enum.Enum):
    """The kinds of constraint, named as vLLM's ``structured_outputs`` fields."""

    JSON = "json"  # spec: a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # spec: "" (any JSON object)
    REGEX = "regex"  # spec: a regular expression the whole output matches
    CHOICE = "choice"  # spec: a JSON list of strings; the output is one of them
    GRAMMAR = "grammar"  # spec: an EBNF grammar (xgrammar's dialect, GBNF-like)
    STRUCTURAL_TAG = "structural_tag"  # spec: an xgrammar structural tag, as JSON text


@dataclass(frozen=True)
class StructuredOutputParams:
    """One constraint on a request's generated text, carried inside ``SamplingParams``.

    The engine compiles ``(kind, spec)`` into a token-level grammar once and caches it;
    every sampled token of the request is then drawn from the tokens the grammar allows
    (and EOS only where the grammar may end). JSON schemas are checked against the
    supported keyword subset by :func:`check_json_schema` before they get here.

    Raises:
        ValueError: an empty spec (except ``json_object``), a ``choice`` spec that is not a
            non-empty JSON list of strings, or a ``json``/``structural_tag`` spec that is not
            JSON.
    """

    kind: StructuredOutputKind
    spec: str = ""

    def __post_init__(self) -> None:
        kind = StructuredOutputKind(self.kind)
        object.__setattr__(self, "kind", kind)
        if kind is StructuredOutputKind.JSON_OBJECT:
            return
        if not self.spec:
            raise ValueError(f"structured output {kind.value!r} needs a non-empty spec")
        if kind is StructuredOutputKind.CHOICE:
            choices = json.loads(self.spec)
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise ValueError("choice must be a non-empty list of non-empty strings")
        elif kind in (StructuredOutputKind.JSON, StructuredOutputKind.STRUCTURAL_TAG):
            try:
                json.loads(self.spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{kind.value} spec is not valid JSON: {exc}") from None

    @property
    def cache_key(self) -> tuple[str, str]:
        """Key of the compiled grammar: equal specs share one compilation."""
        return (self.kind.value, self.spec)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutputParams:
        """The output is exactly one of ``choices``."""
        return cls(StructuredOutputKind.CHOICE, json.dumps(list(choices)))

    @classmethod
    def json_schema(cls, schema: dict | bool) -> StructuredOutputParams:
        """The output is a JSON value valid against ``schema``."""
        return cls(StructuredOutputKind.JSON, json.dumps(schema))
