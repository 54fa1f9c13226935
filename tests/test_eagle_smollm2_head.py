"""The EAGLE head shipped for the default model (pdserve/data/eagle/smollm2-135m-instruct)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.loader import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    load_tokenizer,
    resolve_model,
)
from pdserve.engine.spec_decode.eagle import bundled_head_dir, load_eagle_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def default_model_path():
    try:
        return resolve_model(None)
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not installed: {exc}")


@pytest.fixture(scope="module")
def target(default_model_path):
    from pdserve.offline.eagle.features import load_target_model

    return load_target_model(default_model_path, 512)  # packed attention: features in one pass


def test_default_model_has_a_shipped_head_with_provenance():
    folder = bundled_head_dir(DEFAULT_MODEL)
    assert folder is not None
    config = json.loads((folder / "config.json").read_text())
    provenance = config["pdserve_provenance"]
    assert provenance["trained_by"] == "pdserve train-eagle"
    assert 1.0 <= provenance["heldout_mean_acceptance_length_k4"] <= 5.0
    assert (folder / "README.md").is_file()
    assert (folder / "model.safetensors").stat().st_size < 16 * 2**20


def test_shipped_head_loads_onto_the_default_model(target):
    head = load_eagle_model(bundled_head_dir(DEFAULT_MODEL), target, TorchAttentionBackend(CPU),
                            512, torch.float32)
    assert head.cfg.layout == "eagle1" and head.num_layers == 1
    assert (head.num_kv_heads, head.head_dim) == (target.cfg.num_kv_heads, target.cfg.head_dim)


def test_shipped_head_drafts_over_a_frequency_ranked_vocabulary(target):
    head = load_eagle_model(bundled_head_dir(DEFAULT_MODEL), target, TorchAttentionBackend(CPU),
                            512, torch.float32)
    ids = head.draft_token_ids()
    assert head.has_draft_vocab and len(ids) == 8192 and len(ids.unique()) == 8192
    eos = target.cfg.hf_config.get("eos_token_id")
    assert eos in ids.tolist()  # answers end with EOS: it must be draftable


#: Chat requests written for this test (not from the training data) and the acceptance
#: length the shipped head must keep on them (k = 4: the head of session 11 2.00 on 128-token
#: answers, per position 0.53 0.52 0.50 0.44; earlier heads 1.94, 1.85, 1.85, 1.79, 1.66,
#: 1.55-1.57, 1.50 and 1.2; a random head ~1.0). The issue's target is 2.5 on held-out prompts:
#: 2.55 on the bf16-made held-out set, 2.51 on the float32-made one (bench/eagle_heldout.py).
FRESH_REQUESTS = (
    "Explain why the sky is blue.", "Write a short story about a lighthouse keeper.",
    "What are three good habits for a healthy sleep?", "How does a bicycle stay upright?",
    "Give me a recipe for a simple vegetable soup.", "What is the difference between weather "
    "and climate?", "Write a polite email asking for a meeting next week.",
    "Why do cats purr?",
)
MIN_ACCEPTANCE_LENGTH = 1.6


@pytest.mark.slow
def test_shipped_head_drafts_the_default_models_greedy_answer(default_model_path, target):
    """On fresh chat requests, chained k=4 drafts agree with the target's greedy answers
    (the issue's acceptance figure on held-out prompts, printed)."""
    from pdserve.engine import LLM, SamplingParams
    from pdserve.offline.eagle.acceptance import estimate_acceptance
    from pdserve.offline.eagle.data import DistillSequence
    from pdserve.offline.eagle.features import compute_target_features

    llm = LLM(str(default_model_path), dtype="float32", load_progress=False,
              max_model_len=512)
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": text}])
               for text in FRESH_REQUESTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=96),
                        detokenize=False)
    seqs = [DistillSequence(p, list(o.outputs[0].token_ids), True) for p, o in zip(prompts, outs)]
    data = compute_target_features(target, seqs, use_tqdm=False)
    head = load_eagle_model(bundled_head_dir(DEFAULT_MODEL), target, TorchAttentionBackend(CPU),
                            512, torch.float32)
    estimate = estimate_acceptance(head, data, num_speculative_tokens=4)
    print(f"shipped head on {len(FRESH_REQUESTS)} fresh requests: {estimate.summary()}")
    assert estimate.mean_acceptance_length >= MIN_ACCEPTANCE_LENGTH


def test_target_writes_its_own_chat_requests(default_model_path):
    """Magpie-style prompts: the user-turn prefix of SmolLM2's ChatML template, continued by
    the model itself, gives distinct, finished requests, the same for the same seed."""
    from pdserve.engine import LLM
    from pdserve.offline.eagle.data import (
        generate_self_written_prompts,
        self_written_specs,
        user_turn_prefix_ids,
    )

    llm = LLM(str(default_model_path), dtype="float32", load_progress=False, max_model_len=256)
    prefix = llm.tokenizer.decode(user_turn_prefix_ids(llm.tokenizer))
    assert prefix.endswith("<|im_start|>user\n") and "<|im_start|>system" in prefix
    texts = generate_self_written_prompts(llm, 6, seed=1, use_tqdm=False)
    assert len(texts) == len(set(texts)) == 6
    assert all(len(t.split()) >= 4 and "<|im_end|>" not in t for t in texts)
    assert generate_self_written_prompts(llm, 6, seed=1, use_tqdm=False) == texts
    openers = ("Explain", "Write a poem about")
    begun = generate_self_written_prompts(llm, 4, seed=1, use_tqdm=False, openers=openers)
    assert len(set(begun)) == 4 and all(t.startswith(openers) for t in begun)
    assert sum(t.startswith("Explain") for t in begun) >= 1
    specs = self_written_specs(texts, 2)
    assert [s.is_held_out for s in specs] == [False] * 4 + [True] * 2
    assert all(s.is_chat for s in specs)


def test_train_eagle_runs_end_to_end_and_caches_each_self_written_round(
        default_model_path, target, tmp_path, monkeypatch):
    """``pdserve train-eagle`` on the default model from a text file, with self-written
    requests and one extra round: it writes a loadable head whose README and provenance
    describe the round, the round's answers and features are cached on their own, the
    round repeats no earlier prompt, and a second run reuses every cache."""
    from importlib import resources

    from pdserve.cli import main
    from pdserve.offline.eagle.data import load_sequences

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    text = Path(str(resources.files("pdserve.data"))) / "held_text.txt"
    argv = ["train-eagle", "--model", str(default_model_path), "--data", str(text),
            "--num-prompts", "4", "--num-held-out", "2", "--max-answer-tokens", "8",
            "--self-written-prompts", "8", "--extra-self-written", "6:12", "--epochs", "1",
            "--batch-tokens", "512", "--draft-vocab-size", "64"]
    assert main([*argv, "--out", str(tmp_path / "head")]) == 0
    data = tmp_path / "cache" / "eagle-data"
    [round_file] = [f for f in data.glob("*.self-written.jsonl")
                    if len(load_sequences(f)) == 6]  # cached as generated
    extra = load_sequences(round_file)
    assert not any(s.is_held_out for s in extra)
    assert all(len(s.answer_ids) <= 12 for s in extra)
    earlier = {tuple(s.prompt_ids) for f in data.glob("*.jsonl") if f != round_file
               for s in load_sequences(f)}
    kept = [s for s in extra if tuple(s.prompt_ids) not in earlier]  # trained on
    assert round_file.with_suffix("").with_suffix(".features.pt").is_file()
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    provenance = config["pdserve_provenance"]
    assert provenance["extra_self_written"] == [
        {"count": 6, "max_answer_tokens": 12, "kept": len(kept)}]
    assert provenance["num_train_sequences"] == 4 + 8 + len(kept)
    assert "a round of 6 more self-written requests (seed 1" in (
        tmp_path / "head" / "README.md").read_text()
    head = load_eagle_model(tmp_path / "head", target, TorchAttentionBackend(CPU), 256,
                            torch.float32)
    assert head.cfg.draft_vocab_size == 64
    cached = sorted(f.name for f in data.iterdir())
    mtimes = {f.name: f.stat().st_mtime_ns for f in data.iterdir()}
    assert provenance["command"] == ["pdserve", *argv, "--out", str(tmp_path / "head")]
    assert main([*argv, "--out", str(tmp_path / "again")]) == 0
    assert sorted(f.name for f in data.iterdir()) == cached
    assert {f.name: f.stat().st_mtime_ns for f in data.iterdir()} == mtimes
    # the same seed gives the same head whether the data was generated or read from the cache
    first = load_file(tmp_path / "head" / "model.safetensors")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    # --train-seed: the same cached data (nothing made again), another init and batch order
    assert main([*argv, "--train-seed", "1", "--out", str(tmp_path / "reseeded")]) == 0
    assert {f.name: f.stat().st_mtime_ns for f in data.iterdir()} == mtimes
    reseeded = load_file(tmp_path / "reseeded" / "model.safetensors")
    assert any(not torch.equal(first[k], reseeded[k]) for k in first)
    other = json.loads((tmp_path / "reseeded" / "config.json").read_text())["pdserve_provenance"]
    assert other["train_seed"] == 1 and provenance["train_seed"] is None
    assert other["num_train_tokens"] == provenance["num_train_tokens"]
    assert "seed 0 (training: 1)" in (tmp_path / "reseeded" / "README.md").read_text()
    # a run stopped while answering a round keeps the requests already written: with the
    # answers gone, the next run answers the cached requests (one edited here to show it)
    requests_file = round_file.with_suffix(".requests.json")
    requests = json.loads(requests_file.read_text())
    assert len(requests) == 6
    requests[0] = "Name three rivers in Europe."
    requests_file.write_text(json.dumps(requests))
    round_file.unlink()
    round_file.with_suffix("").with_suffix(".features.pt").unlink()
    assert main([*argv, "--out", str(tmp_path / "resumed")]) == 0
    resumed = load_sequences(round_file)
    assert len(resumed) == 6 and [s.prompt_ids for s in resumed[1:]] == [
        s.prompt_ids for s in extra[1:]]
    tokenizer = load_tokenizer(default_model_path)
    assert "Name three rivers in Europe." in tokenizer.decode(resumed[0].prompt_ids)
    # --init-from default continues the shipped head, at its MLP width unless told otherwise
    shipped = bundled_head_dir(DEFAULT_MODEL)
    assert main([*argv, "--init-from", "default", "--out", str(tmp_path / "cont")]) == 0
    cont = json.loads((tmp_path / "cont" / "config.json").read_text())
    width = json.loads((shipped / "config.json").read_text())["intermediate_size"]
    assert cont["intermediate_size"] == width > target.cfg.intermediate_size
    # the provenance names the shipped head and its weights, not this machine's path
    assert cont["pdserve_provenance"]["init_from"] == "default"
    weights = hashlib.sha256((shipped / "model.safetensors").read_bytes()).hexdigest()[:16]
    assert cont["pdserve_provenance"]["init_from_sha256"] == weights
    assert f"Continued from the head `default` (model.safetensors SHA-256 {weights}...)" in (
        tmp_path / "cont" / "README.md").read_text()
    assert "- A new head." in (tmp_path / "head" / "README.md").read_text()
    # --data-dtype bfloat16: the data made in bf16 is cached apart, never mixed with fp32's
    before = {f.name for f in data.glob("*.jsonl")}
    assert main([*argv, "--data-dtype", "bfloat16", "--out", str(tmp_path / "bf16")]) == 0
    made = {f.name for f in data.glob("*.jsonl")} - before
    assert len(made) == 3  # text answers, self-written requests' answers, the extra round
    assert all(len(load_sequences(data / name)) > 0 for name in made)
    bf16 = json.loads((tmp_path / "bf16" / "config.json").read_text())["pdserve_provenance"]
    assert bf16["data_dtype"] == "bfloat16" and provenance["data_dtype"] == "float32"
    assert "engine in bfloat16" in (tmp_path / "bf16" / "README.md").read_text()

