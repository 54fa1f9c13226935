"""Bad configuration fails early with an error naming the field or path."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, EngineConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": -16}, "block_size"),
        ({"dtype": "float8"}, "dtype"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction"),
        ({"num_kv_blocks": 4, "kv_cache_memory_bytes": 1 << 20}, "num_kv_blocks"),
        ({"device": "tpu"}, "device"),
        ({"max_model_len": 0}, "max_model_len"),
    ],
)
def test_invalid_field_raises_value_error_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_max_model_len_above_model_limit_is_rejected(tiny_model):
    _, path, model = tiny_model
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(path), max_model_len=limit + 1, load_progress=False)


def test_missing_model_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(missing), load_progress=False)


def test_kv_budget_too_small_for_one_sequence_is_rejected(tiny_model):
    _, path, _ = tiny_model
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(str(path), num_kv_blocks=2, block_size=16, max_model_len=512, load_progress=False)


def test_draft_confidence_without_a_model_drafter_is_rejected():
    with pytest.raises(ValueError, match="speculative_draft_confidence applies to the model "
                                         "drafters"):
        EngineConfig(speculative_method="ngram", speculative_draft_confidence=0.5)


@pytest.mark.parametrize("argv, message", [
    (["--speculative-method", "ngram", "--speculative-draft-confidence", "0.5"],
     "--speculative-draft-confidence applies to the model drafters (eagle, draft), not "
     "--speculative-method='ngram'"),
    (["--speculative-draft-confidence", "1.5"],
     "--speculative-draft-confidence must be a number in [0, 1), got 1.5"),
    (["--speculative-method", "eagle"],
     "--speculative-model is required for --speculative-method='eagle'"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be positive, got 0"),
    # the speculative model is checked before anything loads (serve: before workers start)
    (["--speculative-method", "eagle", "--speculative-model", "/nonexistent/head"],
     "speculative model folder '/nonexistent/head' does not exist"),
    (["--speculative-method", "eagle", "--speculative-model", "/"],
     "speculative model folder '/' has no config.json"),
    (["--speculative-method", "draft", "--speculative-model", "/nonexistent/m"],
     "speculative model '/nonexistent/m' not found: '/nonexistent/m' does not exist (expected "
     "a checkpoint folder with config.json, a .gguf file, or 'SmolLM2-135M-Instruct')"),
    (["--speculative-disable-by-batch-size", "2"],
     "--speculative-disable-by-batch-size needs a --speculative-method (eagle, draft or "
     "ngram); speculation is off"),
])
def test_cli_names_the_flag_in_one_line(argv, message, capsys):
    """``pdserve decode-worker`` and ``serve`` check the engine config before loading or
    starting anything; the error names the flag the user wrote, not the config field."""
    from pdserve.cli import main

    assert main(["decode-worker", "--router", "tcp://127.0.0.1:1", *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"pdserve: error: {message}\n"
    assert main(["serve", "--port", "1", *argv]) == 2
    assert capsys.readouterr().err == err


def test_cli_help_says_what_each_default_is():
    """No option's help ends in a bare ``(default: None)``: an option left unset says what
    leaving it out does, in its own words."""
    import argparse

    from pdserve.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for name, parser in sub.choices.items():
        text = parser.format_help()
        assert "(default: None)" not in text, name
        checked += 1
    assert checked >= 8
    serve = sub.choices["serve"].format_help()
    assert "default: no token" in " ".join(serve.split())


@pytest.mark.parametrize("method, extra, expected", [
    ("eagle", {"speculative_model": "default"}, 2),
    ("draft", {"speculative_model": "x"}, 4),
    ("ngram", {}, 4),
    ("eagle", {"speculative_model": "default", "num_speculative_tokens": 5}, 5),
])
def test_num_speculative_tokens_defaults_per_method(method, extra, expected):
    """Unset, k is the method's measured default (DEFAULT_NUM_SPECULATIVE_TOKENS); given, it
    stays; and serve passes the flag to its workers only when given, so a worker resolves
    the same value."""
    import argparse

    from pdserve.engine.entrypoints.arg_utils import (
        add_engine_args,
        engine_args_to_argv,
        engine_config_from_args,
    )

    assert EngineConfig(speculative_method=method, **extra).num_speculative_tokens == expected
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = ["--speculative-method", method]
    if "num_speculative_tokens" in extra:
        argv += ["--num-speculative-tokens", str(extra["num_speculative_tokens"])]
    if method == "eagle":  # draft's "x" is no model folder: the config check would refuse it
        argv += ["--speculative-model", extra["speculative_model"]]
    worker_argv = engine_args_to_argv(parser.parse_args(argv))
    assert ("--num-speculative-tokens" in worker_argv) == ("num_speculative_tokens" in extra)
    if method != "draft":
        worker = engine_config_from_args(parser.parse_args(worker_argv), None)
        assert worker.num_speculative_tokens == expected
