"""Structured outputs: grammar-constrained decoding (JSON schema, regex, choice, EBNF, tags)."""

from pdserve.engine.structured_output.backend import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    apply_token_bitmask,
    validate_structured_output,
)
from pdserve.engine.structured_output.manager import StepMasks, StructuredOutputManager
from pdserve.engine.structured_output.params import StructuredOutputKind, StructuredOutputParams
from pdserve.engine.structured_output.schema_check import (
    UnsupportedSchemaError,
    check_json_schema,
)

__all__ = [
    "GrammarCompiler", "GrammarError", "GrammarMatcher", "StepMasks",
    "StructuredOutputKind", "StructuredOutputManager", "StructuredOutputParams",
    "UnsupportedSchemaError", "apply_token_bitmask", "check_json_schema",
    "validate_structured_output",
]
