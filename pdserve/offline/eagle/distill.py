"""The self-distillation data of ``train-eagle``: the target's answers to the prompts, its
features on them, and the frequency-ranked draft vocabulary they give.

Everything the target computes is cached under ``<cache>/eagle-data`` by content hash
(answers as ``*.jsonl``, self-written requests beside them as ``*.requests.json``, target
features as ``*.features.pt``), so that a rerun with the same recipe loads instead of
generating, and an appended round of self-written requests is the only part computed.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from pdserve.offline.eagle.data import (
    REQUEST_OPENERS,
    DistillSequence,
    PromptSpec,
    data_cache_key,
    generate_answers,
    generate_self_written_prompts,
    load_prompt_specs,
    load_sequences,
    save_sequences,
    self_written_specs,
)
from pdserve.offline.eagle.features import TargetFeatures, compute_target_features
from pdserve.offline.eagle.train_config import TrainEagleConfig


def lazy_target_llm(cfg: TrainEagleConfig, model_path: Path):
    """A function returning the target as a :class:`pdserve.engine.LLM` in ``cfg.data_dtype``,
    loaded on the first call (a run whose data is all cached never loads it)."""
    from pdserve.engine.entrypoints.llm import LLM

    llm = None

    def target_llm():
        nonlocal llm
        if llm is None:
            # 64 running requests on CPU: the torch backend gathers each request's context
            # per layer, and at 256 half the CPU time went to the kernel (page faults)
            llm = LLM(str(model_path), dtype=cfg.data_dtype, device=cfg.device, load_progress=False,
                      max_model_len=2048, max_num_seqs=64 if cfg.device == "cpu" else 256)
        return llm

    return target_llm


def self_written_cache(cfg: TrainEagleConfig, model_path: Path) -> tuple[Path, str]:
    """Where the answers to ``cfg``'s self-written requests (``self_written_prompts`` plus
    one in eight held out) are cached, and the cache key in that file's name; the requests
    themselves are kept beside it (``*.requests.json``, see :func:`cached_requests`)."""
    from pdserve.engine.loader.default_model import default_cache_dir

    count, held = cfg.self_written_prompts, max(1, cfg.self_written_prompts // 8)
    key = data_cache_key(model_path, [PromptSpec(f"self-written {count} {held} "
                                                 f"{cfg.hyper.seed}", True, False)],
                         cfg.max_answer_tokens, cfg.data_dtype)
    return default_cache_dir() / "eagle-data" / f"{key}.self-written.jsonl", key

@dataclass
class ExtraRound:
    """An extra self-written round: its cache stem, its sequences as generated, and which
    of them to train on (False: the prompt repeats an earlier one)."""

    stem: Path
    sequences: list[DistillSequence]
    keep: list[bool]

    @property
    def kept(self) -> list[DistillSequence]:
        """The sequences to train on, in order."""
        return [s for s, k in zip(self.sequences, self.keep) if k]


def self_distill_data(cfg: TrainEagleConfig, model_path: Path, use_tqdm: bool, log=print,
                      ) -> tuple[list[DistillSequence], Path, list[ExtraRound]]:
    """The target's answers to the prompts, generated once and cached by content hash.

    Returns the sequences (text prompts', then self-written requests'), the cache file's
    path without suffix (for derived caches), and each extra self-written round.
    """
    target_llm = lazy_target_llm(cfg, model_path)
    sequences, stem = _text_answers(cfg, model_path, target_llm, use_tqdm, log)
    if cfg.self_written_prompts:
        written, key = _self_written_answers(cfg, model_path, target_llm, use_tqdm, log)
        sequences = sequences + written
        stem = stem.with_name(f"{stem.name}-sw{key}")
    rounds = _extra_rounds(cfg, model_path, stem.parent, {tuple(s.prompt_ids) for s in sequences},
                           target_llm, use_tqdm, log)
    return sequences, stem, rounds


def _cached_sequences(cache: Path, generate: Callable[[], list[DistillSequence]],
                      ) -> list[DistillSequence]:
    """The sequences saved in ``cache``, else ``generate()``'s, saved there."""
    if cache.is_file():
        return load_sequences(cache)
    sequences = generate()
    save_sequences(cache, sequences)
    return sequences


def _text_answers(cfg: TrainEagleConfig, model_path: Path, target_llm, use_tqdm: bool,
                  log) -> tuple[list[DistillSequence], Path]:
    """The answers to the prompts of ``cfg.data`` and their cache's stem (a warning when
    the data gives fewer prompts than asked for)."""
    from pdserve.engine.loader.default_model import default_cache_dir

    specs = load_prompt_specs(cfg.data, cfg.num_prompts, cfg.num_held_out, cfg.hyper.seed)
    num_held = sum(s.is_held_out for s in specs)
    if (len(specs) - num_held, num_held) != (cfg.num_prompts, cfg.num_held_out):
        log(f"warning: --data {cfg.data} gives {len(specs) - num_held} training and {num_held} "
            f"held-out prompts (asked for {cfg.num_prompts} and {cfg.num_held_out})")
    stem = default_cache_dir() / "eagle-data" / data_cache_key(
        model_path, specs, cfg.max_answer_tokens, cfg.data_dtype)
    return _cached_sequences(stem.with_suffix(".jsonl"), lambda: generate_answers(
        target_llm(), specs, cfg.max_answer_tokens, use_tqdm=use_tqdm,
        desc="answers to text prompts")), stem


def _self_written_answers(cfg: TrainEagleConfig, model_path: Path, target_llm, use_tqdm: bool,
                          log) -> tuple[list[DistillSequence], str]:
    """The target's answers to ``self_written_prompts`` (+ one in eight held out) requests
    it writes itself, and their cache key."""
    count, held = cfg.self_written_prompts, max(1, cfg.self_written_prompts // 8)
    cache, key = self_written_cache(cfg, model_path)

    def write_and_answer() -> list[DistillSequence]:
        texts = cached_requests(cache, count + held, lambda: (
            generate_self_written_prompts(target_llm(), count + held, cfg.hyper.seed,
                                          use_tqdm=use_tqdm, desc="write requests")), log)
        return generate_answers(target_llm(), self_written_specs(texts, held),
                                cfg.max_answer_tokens, use_tqdm=use_tqdm,
                                desc="answers to self-written requests")

    return _cached_sequences(cache, write_and_answer), key


def _extra_rounds(cfg: TrainEagleConfig, model_path: Path, folder: Path,
                  seen: set[tuple[int, ...]], target_llm, use_tqdm: bool,
                  log) -> list[ExtraRound]:
    """Each of ``cfg.extra_self_written``'s rounds, cached in ``folder``.

    A round is cached as generated (its key: count, seed, openers, answer length) and
    filtered here, against ``seen`` (the prompts before it in this run, updated).
    """
    rounds = []
    for r, (count, max_tokens) in enumerate(cfg.extra_self_written, start=1):
        seed = cfg.hyper.seed + r
        key = data_cache_key(model_path, [PromptSpec(
            f"self-written round {count} {seed} openers {'|'.join(REQUEST_OPENERS)}",
            True, False)], max_tokens, cfg.data_dtype)
        cache = folder / f"{key}.self-written.jsonl"

        def write_and_answer() -> list[DistillSequence]:
            texts = cached_requests(cache, count, lambda: generate_self_written_prompts(
                target_llm(), count, seed, use_tqdm=use_tqdm, openers=REQUEST_OPENERS,
                desc=f"round {r}: write requests"), log)
            return generate_answers(target_llm(), self_written_specs(texts, 0), max_tokens,
                                    use_tqdm=use_tqdm, desc=f"round {r}: answers")

        written = _cached_sequences(cache, write_and_answer)
        keep = [tuple(s.prompt_ids) not in seen for s in written]
        seen.update(tuple(s.prompt_ids) for s in written)
        rounds.append(ExtraRound(cache.with_suffix(""), written, keep))
    return rounds


def cached_requests(answers_cache: Path, count: int, write, log=print) -> list[str]:
    """Self-written requests, kept beside ``answers_cache`` (``*.requests.json``) as soon as
    they are written, so that a run stopped while answering them (the longer half of a
    round) does not write them again; ``write()`` makes them on a miss. A file that is not
    a JSON list of 1 to ``count`` non-empty strings (the writer may find fewer distinct ones)
    is reported by name and written again."""
    cache = answers_cache.with_suffix(".requests.json")
    if cache.is_file():
        try:
            texts = json.loads(cache.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError):
            texts = None
        if (isinstance(texts, list) and 0 < len(texts) <= count
                and all(isinstance(t, str) and t for t in texts)):
            return texts
        log(f"warning: {cache} is not a list of 1 to {count} requests; writing them again")
    texts = write()
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(texts, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, cache)
    return texts


def cached_features(target, sequences: list[DistillSequence], cache: Path, use_tqdm: bool,
                    desc: str, aux_layer_ids: tuple[int, ...] = ()) -> list[TargetFeatures]:
    """:func:`compute_target_features`, cached in ``cache`` (a torch file) across runs."""
    if cache.is_file():
        return [TargetFeatures(**d) for d in torch.load(cache, weights_only=True)]
    data = compute_target_features(target, sequences, use_tqdm=use_tqdm, desc=desc,
                                   aux_layer_ids=aux_layer_ids)
    tmp = cache.with_suffix(".tmp")
    torch.save([asdict(d) for d in data], tmp)
    tmp.replace(cache)
    return data


def cap_tokens(sequences: list[DistillSequence], max_tokens: int | None,
               ) -> list[DistillSequence]:
    """The first ``sequences`` whose prompt and answer tokens total at most ``max_tokens``
    (None: all of them)."""
    if max_tokens is None:
        return sequences
    kept, total = [], 0
    for seq in sequences:
        n = len(seq.prompt_ids) + len(seq.answer_ids)
        if total + n > max_tokens:
            break
        kept.append(seq)
        total += n
    return kept



def frequent_token_ids(sequences: list[DistillSequence], size: int, vocab_size: int,
                       ) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent answer token ids of ``sequences`` (FR-Spec's ranking).

    Ids that never occur fill the rest in id order (so ``size`` may exceed the number of
    distinct answer tokens).

    Returns:
        ``([size] int64 ids, most frequent first; fraction of answer tokens they cover)``.
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        counts += torch.bincount(torch.tensor(seq.answer_ids, dtype=torch.int64),
                                 minlength=vocab_size)
    # stable: equal counts keep id order
    order = torch.sort(counts, descending=True, stable=True).indices[:size]
    covered = float(counts[order].sum()) / max(1, int(counts.sum()))
    return order, covered
