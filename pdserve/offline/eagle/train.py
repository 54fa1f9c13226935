"""``pdserve train-eagle``: train an EAGLE-1/2 or EAGLE-3 head for a served model by
self-distillation.

Pipeline (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"; data as in its self-distillation variant, sec. 5.3)::

    text (Brown corpus | file) -> prompts ("Continue this text:", "Summarize:", raw, ...)
      -> target's greedy answers (our engine, batched; cached under <cache>/eagle-data)
      -> target features + top-k next-token distributions over prompt + answer
      -> train the head (regression + classification, feature noise)
      -> held-out acceptance estimate (greedy chain drafting, k = 4)
      -> <out>/config.json, model.safetensors (bf16, official EAGLE-1 names), README.md

An EAGLE-3 head (``--head-layout eagle3``; Li et al. 2025, "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test") keeps the target's fused
low/mid/high layer inputs as features instead of its final hidden states, trains on tokens
alone (no feature regression) and writes the official EAGLE-3 names (``midlayer.*``, its
own ``norm`` and ``lm_head`` over the draft vocabulary, ``d2t``/``t2d``).

The steps live beside this driver: :mod:`.train_config` (settings and the checks made
before any work), :mod:`.distill` (the data and its caches), :mod:`.trainer` (the training
loop), :mod:`.acceptance` (the estimate), :mod:`.head_io` (new, continued and saved
heads) and :mod:`.readme`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.loader.gguf_convert import file_sha256
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.spec_decode.eagle import EagleDraftModel
from pdserve.offline.eagle.acceptance import AcceptanceEstimate, estimate_acceptance
from pdserve.offline.eagle.data import DistillSequence
from pdserve.offline.eagle.distill import (
    ExtraRound,
    cached_features,
    cached_requests,
    cap_tokens,
    frequent_token_ids,
    lazy_target_llm,
    self_distill_data,
    self_written_cache,
)
from pdserve.offline.eagle.features import TargetFeatures, load_target_model
from pdserve.offline.eagle.head_io import (
    head_config_dict,
    head_state_dict,
    load_init_weights,
    new_head,
    save_head,
)
from pdserve.offline.eagle.readme import write_readme
from pdserve.offline.eagle.train_config import (
    DATA_DTYPES,
    OUT_FILES,
    TrainEagleConfig,
    check_fits_target,
    init_head_folder,
    probe_out_folder,
)
from pdserve.offline.eagle.trainer import TrainHistory, TrainHyperParams, train_head

__all__ = [
    "DATA_DTYPES", "OUT_FILES", "TrainEagleConfig", "TrainEagleResult", "TrainHyperParams",
    "cached_requests", "frequent_token_ids", "head_config_dict", "head_state_dict",
    "init_head_folder", "lazy_target_llm", "load_init_weights", "new_head",
    "run_train_eagle", "save_head", "self_written_cache", "write_readme",
]


@dataclass
class TrainEagleResult:
    """What a run produced: the head, its history and the held-out estimate."""

    out: Path
    history: TrainHistory
    estimate: AcceptanceEstimate
    num_train_sequences: int
    num_train_tokens: int
    num_held_out_sequences: int
    elapsed_s: float
    draft_vocab_size: int | None = None
    draft_vocab_coverage: float = 1.0
    estimate_by_source: dict = field(default_factory=dict)
    extra_rounds_kept: list[int] = field(default_factory=list)
    aux_layer_ids: tuple[int, ...] = ()


@dataclass
class _TrainingData:
    """The target and what the head trains and is evaluated on.

    Attributes:
        target: the target in fp32 (the head shares its embedding and LM head).
        max_position: the head's rotary table length (longest sequence + 8).
        sequences: the text prompts' then the self-written requests' sequences.
        train_seqs / held_seqs: the training (capped, plus the kept extra rounds) and
            held-out sequences; train_data / held_data: their target features.
        aux_layer_ids: the target layers the head reads (empty: the final hidden state).
        rounds: the extra self-written rounds.
    """

    target: LlamaForCausalLM
    max_position: int
    sequences: list[DistillSequence]
    train_seqs: list[DistillSequence]
    held_seqs: list[DistillSequence]
    train_data: list[TargetFeatures]
    held_data: list[TargetFeatures]
    aux_layer_ids: tuple[int, ...]
    rounds: list[ExtraRound]


def run_train_eagle(cfg: TrainEagleConfig, use_tqdm: bool = True, log=print,
                    command: list[str] | None = None) -> TrainEagleResult:
    """Run the whole pipeline; see the module docstring.

    ``command`` (the CLI's argv, recorded in the head's provenance) says how to rerun it.

    Raises:
        FileNotFoundError: the model or data file does not exist.
        ValueError: bad data (empty file), a model the engine cannot serve, or an ``out``
            folder that cannot be created or written to (probed before any work).
        CorpusFetchError: the Brown corpus could not be fetched.
    """
    from pdserve.engine.loader.default_model import resolve_model

    t0 = time.perf_counter()
    probe_out_folder(Path(cfg.out).expanduser())
    model_path = resolve_model(cfg.model)
    width, aux_ids = check_fits_target(cfg, model_path)
    torch.manual_seed(cfg.hyper.seed)
    data = _training_data(cfg, model_path, aux_ids, use_tqdm, log)
    draft_ids, coverage = _draft_vocabulary(cfg, data.train_seqs, data.target.cfg.vocab_size,
                                            log)
    head, history, draft_ids = _train(cfg, data, draft_ids, width, use_tqdm)
    estimate, by_source = _held_out_estimates(cfg, data, head, draft_ids, width, log)

    out = Path(cfg.out).expanduser()
    result = TrainEagleResult(
        out, history, estimate, len(data.train_seqs),
        sum(len(d.token_ids) for d in data.train_data), len(data.held_seqs),
        time.perf_counter() - t0, None if draft_ids is None else len(draft_ids), coverage,
        by_source, [len(r.kept) for r in data.rounds], data.aux_layer_ids)
    provenance = _provenance(cfg, command, model_path, result, head)
    save_head(head, out, provenance)
    write_readme(out, result, cfg, model_path.name, None if cfg.init_from is None else (
        provenance["init_from"], provenance["init_from_sha256"]))
    return result


def _training_data(cfg: TrainEagleConfig, model_path: Path, aux_ids: tuple[int, ...],
                   use_tqdm: bool, log) -> _TrainingData:
    """The self-distilled sequences, the target, and its features on them (cached).

    Raises:
        ValueError: the data gives no training or no held-out sequence.
    """
    sequences, stem, rounds = self_distill_data(cfg, model_path, use_tqdm, log)
    train_seqs = cap_tokens([s for s in sequences if not s.is_held_out], cfg.max_train_tokens)
    held_seqs = [s for s in sequences if s.is_held_out]
    if not train_seqs or not held_seqs:
        raise ValueError("not enough text for both training and held-out prompts")
    max_position = max(len(s.prompt_ids) + len(s.answer_ids)
                       for s in sequences + [s for r in rounds for s in r.sequences]) + 8
    # the head shares fp32 modules of the target; the features come from it in the data's dtype
    target = load_target_model(model_path, max_position, torch.float32, cfg.device)
    feature_target = (target if cfg.data_dtype == "float32" else load_target_model(
        model_path, max_position, DATA_DTYPES[cfg.data_dtype], cfg.device))
    log(f"target features for {len(train_seqs) + sum(len(r.kept) for r in rounds)} training + "
        f"{len(held_seqs)} held-out sequences")
    aux = cfg.head_kind.resolve_aux_layer_ids(aux_ids, target.cfg.num_layers)
    # a head fed the final hidden state keeps the caches' first names
    kind = "" if not aux else f".{cfg.layout}-" + "-".join(map(str, aux))
    suffix = f".{len(train_seqs)}{kind}.features.pt"
    train_data = cached_features(feature_target, train_seqs, stem.with_suffix(".train" + suffix),
                                 use_tqdm, "target features: training", aux)
    held_data = cached_features(feature_target, held_seqs, stem.with_suffix(".held" + suffix),
                                use_tqdm, "target features: held out", aux)
    for i, r in enumerate(rounds, start=1):  # a round's features cached, kept ones trained on
        feats = cached_features(feature_target, r.sequences,
                                r.stem.with_suffix(f"{kind}.features.pt"), use_tqdm,
                                f"target features: round {i}", aux)
        train_data += [f for f, k in zip(feats, r.keep) if k]
        train_seqs = train_seqs + r.kept
    return _TrainingData(target, max_position, sequences, train_seqs, held_seqs, train_data,
                         held_data, aux, rounds)


def _draft_vocabulary(cfg: TrainEagleConfig, train_seqs: list[DistillSequence],
                      vocab_size: int, log) -> tuple[torch.Tensor | None, float]:
    """FR-Spec's draft vocabulary: ``([V_draft] int64 target ids, most frequent first;
    fraction of the training answers' tokens they cover)``, or ``(None, 1.0)`` to draft
    over the whole vocabulary."""
    draft_ids, coverage = None, 1.0
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size < vocab_size:
        draft_ids, coverage = frequent_token_ids(train_seqs, cfg.draft_vocab_size, vocab_size)
        log(f"draft vocabulary: {cfg.draft_vocab_size} most frequent ids cover "
            f"{coverage:.2%} of the training answers' tokens")
    elif cfg.draft_vocab_size is not None:
        log(f"draft vocabulary: {cfg.draft_vocab_size} is not smaller than the target's "
            f"vocabulary ({vocab_size}); drafting over all of it")
    return draft_ids, coverage


def _train(cfg: TrainEagleConfig, data: _TrainingData, draft_ids: torch.Tensor | None,
           width: int | None, use_tqdm: bool,
           ) -> tuple[EagleDraftModel, TrainHistory, torch.Tensor | None]:
    """A new (or ``init_from``) head, trained; returns it, its history and its draft ids
    (a head with its own LM head keeps those of the head it continues)."""
    from pdserve.offline.eagle.packed_attention import PackedCausalAttention

    # the head's init and the batch order do not depend on whether data came from the cache
    hyper = cfg.hyper if cfg.train_seed is None else replace(cfg.hyper, seed=cfg.train_seed)
    torch.manual_seed(hyper.seed)
    head = new_head(data.target, cfg.device, data.max_position, PackedCausalAttention(),
                    draft_ids, width, cfg.layout, data.aux_layer_ids)
    if cfg.init_from is not None:
        load_init_weights(head, init_head_folder(cfg.init_from))
        if head.cfg.has_own_lm_head:  # its own LM head's rows are its draft vocabulary's
            draft_ids = head.draft_token_ids().cpu()
    return head, train_head(head, data.train_data, hyper, use_tqdm=use_tqdm), draft_ids


def _held_out_estimates(cfg: TrainEagleConfig, data: _TrainingData, head: EagleDraftModel,
                        draft_ids: torch.Tensor | None, width: int | None, log,
                        ) -> tuple[AcceptanceEstimate, dict[str, AcceptanceEstimate]]:
    """The trained head's acceptance estimate on the held-out sequences (k = 4), drafting
    through a paged KV cache as in serving; with self-written requests also per source
    (``"text"``, ``"self-written"``)."""
    paged = new_head(data.target, cfg.device, data.max_position,
                     TorchAttentionBackend(torch.device(cfg.device)), draft_ids, width,
                     cfg.layout, data.aux_layer_ids)
    paged.load_state_dict(head.state_dict())
    estimate = estimate_acceptance(paged.eval(), data.held_data, num_speculative_tokens=4)
    log(f"held-out: {estimate.summary()}")
    by_source = {}
    if cfg.self_written_prompts:  # the text's held-out prompts come first, then self-written
        sequences, held_data = data.sequences, data.held_data
        num_text = sum(1 for s in sequences[:len(sequences) - cfg.self_written_prompts
                                            - max(1, cfg.self_written_prompts // 8)]
                       if s.is_held_out)
        for name, part in (("text", held_data[:num_text]), ("self-written", held_data[num_text:])):
            if part:
                by_source[name] = estimate_acceptance(paged, part, num_speculative_tokens=4)
                log(f"held-out {name}: {by_source[name].summary()}")
    return estimate, by_source


def _provenance(cfg: TrainEagleConfig, command: list[str] | None, model_path: Path,
                result: TrainEagleResult, head: EagleDraftModel) -> dict:
    """``pdserve_provenance`` of the head's config.json: how it was made and how it did."""
    history, estimate = result.history, result.estimate
    return {
        "trained_by": "pdserve train-eagle",
        "command": command,
        # "default" stays a name (the shipped head, not this machine's path to it); the
        # weights' hash says which head it was
        "init_from": (None if cfg.init_from is None else "default" if cfg.init_from == "default"
                      else str(init_head_folder(cfg.init_from).resolve())),
        "init_from_sha256": (None if cfg.init_from is None
                             else file_sha256(init_head_folder(cfg.init_from)
                                              / "model.safetensors")[:16]),
        "target": model_path.name,
        "data": cfg.data,
        "num_prompts": cfg.num_prompts,
        "num_held_out": cfg.num_held_out,
        "max_answer_tokens": cfg.max_answer_tokens,
        "data_dtype": cfg.data_dtype,
        "max_train_tokens": cfg.max_train_tokens,
        "device": cfg.device,
        "num_train_sequences": result.num_train_sequences,
        "num_train_tokens": result.num_train_tokens,
        "hyperparameters": asdict(cfg.hyper),
        "train_seed": cfg.train_seed,  # None: hyperparameters.seed
        "num_steps": history.num_steps,
        "loss_vocab_size": history.loss_vocab_size,
        "self_written_prompts": cfg.self_written_prompts,
        "extra_self_written": [{"count": c, "max_answer_tokens": t, "kept": k} for (c, t), k
                               in zip(cfg.extra_self_written, result.extra_rounds_kept)],
        "draft_vocab_size": result.draft_vocab_size,
        "head_intermediate_size": head.cfg.intermediate_size,
        "layout": cfg.layout,
        "aux_layer_ids": list(result.aux_layer_ids),
        "draft_vocab_answer_coverage": round(result.draft_vocab_coverage, 4),
        "train_time_s": round(history.elapsed_s, 1),
        "final_loss": history.losses[-1],
        "heldout_mean_acceptance_length_k4": round(estimate.mean_acceptance_length, 4),
        "heldout_acceptance_rates_k4": [round(r, 4) for r in estimate.acceptance_rates],
        "heldout_mean_acceptance_length_k4_by_source": {
            k: round(v.mean_acceptance_length, 4) for k, v in result.estimate_by_source.items()},
    }
