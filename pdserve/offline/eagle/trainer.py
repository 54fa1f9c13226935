"""The EAGLE-1/2 training loop: feature regression plus next-token classification.

Follows Li et al. 2024 ("EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty", sec. 4): from ``(x_{i+1}, f_i + noise)`` the head predicts ``f̂_{i+1}``;

    L = w_reg * SmoothL1(f̂_{i+1}, f_{i+1})  +  w_cls * CE(p_{i+1}, softmax(lm_head(f̂_{i+1})))

with ``w_reg = 1``, ``w_cls = 0.1`` and uniform feature noise ``U(-0.1, 0.1)``, AdamW, gradient clipping
0.5. Only the head is trained; the target's embedding and LM head are frozen and shared.
Losses count answer positions only (``i >= P - 1``: where the head drafts in serving).

The classification softmax runs over the head's draft vocabulary when it has one
(FR-Spec), else over the ids the teacher ever ranks in its top-k (see :func:`loss_vocab`),
which cuts the cost of the LM head in training several times.

Optionally (``unroll_steps > 1``) each batch is also run again on the head's own
predictions, as in EAGLE-3's training-time test (Li et al. 2025, sec. 3.2): step ``j``
feeds ``f̂`` of step ``j - 1`` instead of ``f``, so the head learns to chain on its own
features. Losses of all steps are averaged. With ``w_reg = 0`` and unrolled steps this is
EAGLE-3's other change (sec. 3.1): no constraint that ``f̂`` be the target's feature, only
that the tokens drawn from it be right, on the head's own chained features.

EAGLE-3 heads (Li et al. 2025) train that way by construction: the first step's feature
is ``fc`` of the target's fused low/mid/high layer inputs (no noise), there is no feature
to regress (``reg`` is reported as 0), and the classification runs through the head's own
norm and LM head over its draft vocabulary. The trainer asks the head's config which
applies (``predicts_target_features``, ``has_own_lm_head``), never its layout name.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm.auto import tqdm

from pdserve.engine.spec_decode.eagle import EagleDraftModel
from pdserve.offline.eagle.features import TargetFeatures
from pdserve.offline.eagle.losses import loss_vocab, step_losses


@dataclass(frozen=True)
class TrainHyperParams:
    """Optimization settings (EAGLE paper defaults where it gives them).

    Raises:
        ValueError: naming the field, for a value out of range.
    """

    epochs: float = 2.0
    lr: float = 5e-4
    batch_tokens: int = 2048
    cls_weight: float = 0.1
    reg_weight: float = 1.0
    feature_noise: float = 0.1
    grad_clip: float = 0.5
    warmup_fraction: float = 0.05
    unroll_steps: int = 1
    max_train_minutes: float | None = None
    restrict_loss_vocab: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.epochs > 0:
            raise ValueError(f"epochs must be positive, got {self.epochs}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.batch_tokens <= 0:
            raise ValueError(f"batch_tokens must be positive, got {self.batch_tokens}")
        if self.cls_weight < 0 or self.reg_weight < 0 or self.feature_noise < 0 \
                or self.grad_clip <= 0:
            raise ValueError("cls_weight, reg_weight and feature_noise must be >= 0, "
                             "grad_clip > 0")
        if self.cls_weight == 0 and self.reg_weight == 0:
            raise ValueError("cls_weight and reg_weight are both 0: nothing to train on")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.unroll_steps < 1:
            raise ValueError(f"unroll_steps must be at least 1, got {self.unroll_steps}")
        if self.max_train_minutes is not None and not self.max_train_minutes > 0:
            raise ValueError(f"max_train_minutes must be positive, got {self.max_train_minutes}")


@dataclass
class TrainHistory:
    """What training did: per optimizer step losses, and totals.

    Attributes:
        losses / reg_losses / cls_losses: per step (mean over unrolled steps).
        top1: per step, fraction of answer positions whose draft argmax equals the
            target's top token (first unrolled step).
        num_steps: optimizer steps; num_tokens: head input tokens processed (all steps);
        elapsed_s: wall time.
        loss_vocab_size: ids in the classification softmax (None: the whole vocabulary).
    """

    losses: list[float] = field(default_factory=list)
    reg_losses: list[float] = field(default_factory=list)
    cls_losses: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    num_steps: int = 0
    num_tokens: int = 0
    elapsed_s: float = 0.0
    loss_vocab_size: int | None = None

    def add_step(self, loss: float, reg: float, cls: float, top1: float,
                 num_tokens: int) -> None:
        """Record one optimizer step's losses, top-1 agreement and head tokens."""
        self.losses.append(loss)
        self.reg_losses.append(reg)
        self.cls_losses.append(cls)
        self.top1.append(top1)
        self.num_steps += 1
        self.num_tokens += num_tokens


def make_batches(data: Sequence[TargetFeatures], batch_tokens: int,
                 rng: random.Random) -> list[list[int]]:
    """Shuffled indices of ``data`` grouped into batches of about ``batch_tokens`` tokens."""
    order = list(range(len(data)))
    rng.shuffle(order)
    batches: list[list[int]] = [[]]
    size = 0
    for i in order:
        n = len(data[i].token_ids)
        if batches[-1] and size + n > batch_tokens:
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += n
    return [b for b in batches if b]


#: A time budget fixes the number of steps from the time of steps 2 .. this one (the
#: first step is slower: allocations, first-touch of the weights).
_CALIBRATION_STEPS = 12


class _StepPlan:
    """Number of optimizer steps and the learning-rate schedule over them.

    Linear warmup over ``warmup_fraction`` of the steps, then cosine decay to 10 %.
    ``total_steps`` may shrink once (a time budget), which rescales the schedule.
    """

    def __init__(self, total_steps: int, warmup_fraction: float) -> None:
        self.total_steps = total_steps
        self.warmup_fraction = warmup_fraction

    @property
    def warmup_steps(self) -> int:
        return max(1, int(self.total_steps * self.warmup_fraction))

    def fit_time(self, budget_s: float, elapsed_s: float, per_step_s: float) -> None:
        """Cap the steps so that all take about ``budget_s``, ``elapsed_s`` of it spent."""
        remaining = int((budget_s - elapsed_s) / max(per_step_s, 1e-9))
        self.total_steps = max(_CALIBRATION_STEPS + 1,
                               min(self.total_steps, _CALIBRATION_STEPS + remaining))

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak learning rate at optimizer step ``step``."""
        warmup = self.warmup_steps
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, self.total_steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def _optimizer(params: list[torch.nn.Parameter], hp: TrainHyperParams, plan: _StepPlan,
               ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (EAGLE's betas, no weight decay) and ``plan``'s learning-rate schedule."""
    optimizer = torch.optim.AdamW(params, lr=hp.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, plan.lr_factor)


def train_head(head: EagleDraftModel, data: Sequence[TargetFeatures], hp: TrainHyperParams,
               use_tqdm: bool = True) -> TrainHistory:
    """Train ``head`` (built with :class:`PackedCausalAttention`) in place on ``data``.

    Args:
        head: the head; only its own parameters are updated.
        data: training sequences with their target features.
        hp: hyperparameters.

    Returns:
        The loss history.

    Raises:
        ValueError: ``data`` is empty.
    """
    if not data:
        raise ValueError("no training sequences")
    backend = head.layer.self_attn.backend
    rng = random.Random(hp.seed)
    generator = torch.Generator().manual_seed(hp.seed)
    batches_per_epoch = len(make_batches(data, hp.batch_tokens, random.Random(0)))
    plan = _StepPlan(max(1, math.ceil(batches_per_epoch * hp.epochs)), hp.warmup_fraction)
    # a head with its own LM head always: its logits are over its draft vocabulary
    vocab = loss_vocab(head, data) if (hp.restrict_loss_vocab or head.cfg.has_own_lm_head
                                       ) else None
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer, scheduler = _optimizer(params, hp, plan)
    history = TrainHistory(loss_vocab_size=None if vocab is None else vocab.size)
    head.train()
    t0 = time.perf_counter()
    bar = tqdm(total=plan.total_steps, desc="train eagle", disable=not use_tqdm)
    while history.num_steps < plan.total_steps:
        for batch_idx in make_batches(data, hp.batch_tokens, rng):
            if history.num_steps >= plan.total_steps:
                break
            if history.num_steps == 1:
                t1 = time.perf_counter()
            if history.num_steps == _CALIBRATION_STEPS and hp.max_train_minutes is not None:
                now = time.perf_counter()
                plan.fit_time(hp.max_train_minutes * 60.0, now - t0,
                              (now - t1) / (_CALIBRATION_STEPS - 1))
                bar.total = plan.total_steps
            loss, reg, cls, top1, num_tokens = step_losses(
                head, [data[i] for i in batch_idx], hp, backend, generator, vocab)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, hp.grad_clip)
            optimizer.step()
            scheduler.step()
            history.add_step(loss.item(), reg, cls, top1, num_tokens)
            bar.update(1)
            bar.set_postfix(loss=f"{history.losses[-1]:.3f}", reg=f"{reg:.3f}", cls=f"{cls:.3f}",
                            top1=f"{top1:.2f}")
    bar.close()
    head.eval()
    history.elapsed_s = time.perf_counter() - t0
    return history
