"""Grammar libraries on this CPU: schema compile time and token-mask time per decode step.

Compares xgrammar and llguidance for the default model's tokenizer (SmolLM2, 49k vocab):

- compile time of a typical JSON schema (cold, then cached) and of "any JSON object";
- mask time per step at batch 1 and 32: every row's matcher fills its bitmask row, then
  consumes the next token of a valid answer (teacher forcing), as the engine does;
- applying the masks to ``[B, V]`` fp32 logits.

Prints a table and, with ``--json PATH``, writes the figures. Run it alone on the machine:
the figures are per-call wall times.

Usage::

    python bench/grammar_backends.py [--model PATH] [--steps 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from pdserve.engine.loader.checkpoint import load_tokenizer
from pdserve.engine.loader.default_model import resolve_model

#: A 10-field schema with nesting, an enum, a list and an integer range (the W1 schema).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string"},
        "city": {"type": "string"},
        "country": {"type": "string", "enum": ["FR", "DE", "US", "JP", "BR"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
        "notes": {"type": "string"},
    },
    "required": ["name", "age", "email", "city", "country", "tags", "score", "active",
                 "address", "notes"],
    "additionalProperties": False,
}

ANSWER = json.dumps({
    "name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "city": "London",
    "country": "FR", "tags": ["math", "engines", "poetry"], "score": 9.5, "active": True,
    "address": {"street": "12 St James's Square", "zip": "SW1Y 4JH"},
    "notes": "Wrote the first published algorithm for a machine.",
})


def _time(fn, repeat: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2)

    def compile_schema(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def compile_json_object(self):
        return self.compiler.compile_builtin_json_grammar()

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor(2)

    def compile_schema(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ",
                                     "key_separator": ": "})
        # llguidance builds its token-level parser lazily: a first matcher does the work
        self.ll.LLMatcher(self.tok, grammar)
        return grammar

    def compile_json_object(self):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
        self.ll.LLMatcher(self.tok, grammar)
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.ll.torch.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            self.ll.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.ll.torch.fill_next_token_bitmask_par(
                self.executor, [(m, row) for row, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def apply(self, logits, bitmask) -> None:
        self.ll.torch.apply_token_bitmask_inplace(logits, bitmask)


def measure(backend, tokenizer, steps: int) -> dict:
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)[:steps]
    first = _time(lambda: backend.compile_schema(SCHEMA))
    schema_variant = dict(SCHEMA, title="variant")  # a new schema: cold again
    cold2 = _time(lambda: backend.compile_schema(schema_variant))
    compiled = backend.compile_schema(SCHEMA)
    cached = _time(lambda: backend.compile_schema(SCHEMA), repeat=5)
    json_object = _time(backend.compile_json_object)
    out = {"compile_schema_first_ms": first * 1e3, "compile_schema_second_schema_ms": cold2 * 1e3,
           "compile_schema_repeat_ms": cached * 1e3, "compile_json_object_ms": json_object * 1e3,
           "answer_tokens": len(answer_ids)}
    for batch in (1, 32):
        matchers = [backend.matcher(compiled) for _ in range(batch)]
        bitmask = backend.bitmask(batch)
        logits = torch.randn(batch, backend.vocab_size)
        fill_s, accept_s, apply_s = [], [], []
        for token in answer_ids:
            fill_s.append(_time(lambda: backend.fill(matchers, bitmask)))
            apply_s.append(_time(lambda: backend.apply(logits, bitmask)))
            start = time.perf_counter()
            for m in matchers:
                if not backend.accept(m, token):
                    raise RuntimeError(f"{backend.name} rejected token {token} of the answer")
            accept_s.append(time.perf_counter() - start)
        out[f"batch{batch}"] = {
            "fill_ms_median": statistics.median(fill_s) * 1e3,
            "fill_ms_p90": sorted(fill_s)[int(0.9 * len(fill_s))] * 1e3,
            "fill_ms_max": max(fill_s) * 1e3,
            "accept_ms_median": statistics.median(accept_s) * 1e3,
            "apply_ms_median": statistics.median(apply_s) * 1e3,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded one)")
    parser.add_argument("--steps", type=int, default=60, help="answer tokens to step through")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = load_tokenizer(resolve_model(args.model))
    vocab_size = len(tokenizer)
    results = {"cpu": platform.processor() or platform.machine(), "vocab_size": vocab_size}
    for cls in (XGrammar, LLGuidance):
        start = time.perf_counter()
        backend = cls(tokenizer, vocab_size)
        setup = time.perf_counter() - start
        results[cls.name] = {"tokenizer_setup_ms": setup * 1e3, **measure(backend, tokenizer,
                                                                           args.steps)}
    for name in ("xgrammar", "llguidance"):
        r = results[name]
        print(f"{name:11s} setup {r['tokenizer_setup_ms']:7.1f} ms | compile schema "
              f"{r['compile_schema_first_ms']:7.1f} ms (2nd schema "
              f"{r['compile_schema_second_schema_ms']:6.1f}, cached "
              f"{r['compile_schema_repeat_ms']:6.2f}) | json_object "
              f"{r['compile_json_object_ms']:6.1f} ms")
        for batch in (1, 32):
            b = r[f"batch{batch}"]
            print(f"{'':11s} batch {batch:2d}: fill {b['fill_ms_median']:6.3f} ms median, "
                  f"p90 {b['fill_ms_p90']:6.3f}, max {b['fill_ms_max']:6.3f}; accept "
                  f"{b['accept_ms_median']:6.3f} ms; apply {b['apply_ms_median']:6.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
