"""Request types for structured outputs and tool calling (OpenAI, plus vLLM's extension).

- ``response_format``: ``{"type": "text" | "json_object" | "json_schema"}`` (OpenAI).
- ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object" |
  "structural_tag": ...}``, exactly one (vLLM's extension, same names).
- ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and the messages that carry tool
  calls and their results (OpenAI chat completions).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator,
                      model_validator)

from pdserve.engine.structured_output import StructuredOutputKind, StructuredOutputParams

#: Function and schema names, as OpenAI restricts them.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JSONSchemaSpec(_Strict):
    """``response_format.json_schema``: a named schema the answer must match."""

    name: str = Field(pattern=NAME_PATTERN)
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    """``response_format``: ``text`` (free), ``json_object`` (any JSON object) or
    ``json_schema`` (the schema's supported subset enforced by the grammar)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self

    def to_params(self) -> StructuredOutputParams | None:
        """The engine constraint, or None for ``text``."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputParams(StructuredOutputKind.JSON_OBJECT)
        schema = self.json_schema.schema_
        return StructuredOutputParams.json_schema(True if schema is None else schema)


class StructuredOutputsOptions(_Strict):
    """vLLM's ``structured_outputs`` extension: exactly one constraint."""

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(None, min_length=1)
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    structural_tag: StrictStr | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsOptions:
        given = [name for name in ("json_", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            names = ", ".join(g.rstrip("_") for g in given) or "none"
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar, json_object, structural_tag (got: {names})")
        return self

    def to_params(self) -> StructuredOutputParams:
        """The engine constraint.

        Raises:
            ValueError: a ``json`` string that is not JSON, an empty choice.
        """
        if self.json_ is not None:
            schema = self.json_ if isinstance(self.json_, dict) else json.loads(self.json_)
            return StructuredOutputParams.json_schema(schema)
        if self.choice is not None:
            return StructuredOutputParams.choice(self.choice)
        if self.json_object:
            return StructuredOutputParams(StructuredOutputKind.JSON_OBJECT)
        for kind, value in ((StructuredOutputKind.REGEX, self.regex),
                            (StructuredOutputKind.GRAMMAR, self.grammar),
                            (StructuredOutputKind.STRUCTURAL_TAG, self.structural_tag)):
            if value is not None:
                return StructuredOutputParams(kind, value)
        raise AssertionError("validated to hold exactly one constraint")


class FunctionDefinition(_Strict):
    """A function the model may call: its name and its arguments' JSON schema."""

    name: str = Field(pattern=NAME_PATTERN)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Whatever ``tool_choice`` is, ``parameters`` must be a valid JSON Schema for an
        object (arguments are a JSON object), as OpenAI checks."""
        if value is None:
            return value
        import jsonschema  # deferred: only requests with tools need it

        try:
            jsonschema.Draft202012Validator.check_schema(value)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.path)
            raise ValueError(f"not a valid JSON schema at #/{where}: {exc.message}") from None
        if value.get("type", "object") != "object":
            raise ValueError(f"the arguments' schema must have type 'object', got "
                             f"{value.get('type')!r}")
        return value

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' schema; no ``parameters`` means an empty argument object."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


class ChatCompletionToolParam(_Strict):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    """The function a named ``tool_choice`` forces (its name in ``tools``)."""

    name: str


class ChatCompletionNamedToolChoice(_Strict):
    """``tool_choice`` naming one function: the model must call it."""

    type: Literal["function"]
    function: NamedFunction


#: ``tool_choice``.
ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoice


class FunctionCall(_Strict):
    """A call's function name and its arguments as JSON text."""

    name: str
    arguments: StrictStr


class ChatCompletionMessageToolCall(_Strict):
    """A tool call in an assistant message of the history."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall

    def arguments_object(self) -> Any:
        """The arguments decoded (templates want an object); the text if it is not JSON."""
        try:
            return json.loads(self.function.arguments)
        except json.JSONDecodeError:
            return self.function.arguments
