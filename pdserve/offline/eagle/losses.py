"""The losses of one EAGLE training batch, over all its unrolled steps (see
:mod:`pdserve.offline.eagle.trainer` for the method and the papers).

Per unrolled step ``j`` the head is fed ``(x_{i+1}, f_i)``: the target's features at the
first step, its own predictions after that; the loss is the feature regression (heads
whose output predicts the target's feature) plus the cross-entropy against the teacher's
top-k next-token distribution, over the loss vocabulary (:func:`loss_vocab`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from pdserve.engine.spec_decode.eagle import EagleDraftModel
from pdserve.offline.eagle.features import TargetFeatures
from pdserve.offline.eagle.packed_attention import PackedCausalAttention

if TYPE_CHECKING:
    from pdserve.offline.eagle.trainer import TrainHyperParams


@dataclass(frozen=True)
class LossVocab:
    """The token ids the classification softmax runs over.

    Attributes:
        lm_head: ``[C, H]`` rows of the target's LM head for the candidate ids (frozen; an
            EAGLE-3 head uses its own LM head and only the maps below).
        index: ``[V]`` int64, the candidate index of each target id (0 for non-candidates).
        member: ``[V]`` bool, which target ids are candidates (teacher mass on the others
            is dropped: a head with a draft vocabulary can never draft them).
    """

    lm_head: torch.Tensor
    index: torch.Tensor
    member: torch.Tensor

    @property
    def size(self) -> int:
        """``C``: the number of candidate ids."""
        return self.lm_head.shape[0]


def loss_vocab(head: EagleDraftModel, data: Sequence[TargetFeatures]) -> LossVocab:
    """Every id the teacher puts in its top-k at a label position of ``data``.

    The classification loss is a softmax over these ids only: the teacher's mass is all
    on them, and the target's LM head rows for the rest are shared and frozen, so they
    only add cost (EAGLE-3's reduced draft vocabulary, applied here to the loss alone;
    the trained head still drafts over the full vocabulary).
    """
    if head.has_draft_vocab:  # the softmax the head drafts with (FR-Spec / EAGLE-3)
        ids = head.draft_token_ids().cpu()
    else:
        ids = torch.cat([d.teacher_ids[d.teacher_probs > 0] for d in data]).unique()
    weight = head.target.lm_head.weight
    index = torch.zeros(weight.shape[0], dtype=torch.int64)
    index[ids] = torch.arange(len(ids))
    member = torch.zeros(weight.shape[0], dtype=torch.bool)
    member[ids] = True
    return LossVocab(weight[ids.to(weight.device)].detach().float(), index.to(weight.device),
                     member.to(weight.device))


@dataclass
class _UnrolledStep:
    """One unrolled step's inputs for the sequences of a batch that still have positions
    to feed (``kept``, as batch indexes), each a list of per-sequence tensors, plus the
    rows of the concatenation that count in the losses and their labels."""

    kept: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)  # positions fed per kept sequence
    ids: list[torch.Tensor] = field(default_factory=list)  # [n] int64 each: x_{i+1}
    hidden: list[torch.Tensor] = field(default_factory=list)  # [n, H] each: f_i (or f̂_i)
    positions: list[torch.Tensor] = field(default_factory=list)  # [n] int64 each: i
    reg_rows: list[torch.Tensor] = field(default_factory=list)  # answer positions
    cls_rows: list[torch.Tensor] = field(default_factory=list)  # ... with a next label
    reg_targets: list[torch.Tensor] = field(default_factory=list)  # [r, H] each: f_{i+1}
    teacher_ids: list[torch.Tensor] = field(default_factory=list)  # [c, k] int64 each
    teacher_probs: list[torch.Tensor] = field(default_factory=list)  # [c, k] fp32 each


def _unrolled_step(head: EagleDraftModel, batch: Sequence[TargetFeatures], j: int,
                   prev: dict[int, torch.Tensor] | None, hp: TrainHyperParams,
                   generator: torch.Generator) -> _UnrolledStep:
    """The inputs of unrolled step ``j`` (from 1): ``(x_{i+1}, f_i)`` for
    ``i = j - 1 .. T - 2``, where ``f_i`` is the target's feature at step 1 (with uniform
    noise for a head that predicts it, fused by ``fc`` for one that does not) and the
    head's own prediction ``prev`` from step ``j - 1`` after that."""
    device = head.fc.weight.device
    regresses = head.cfg.predicts_target_features
    step = _UnrolledStep()
    offset = 0
    for b, seq in enumerate(batch):
        T = len(seq.token_ids)
        first = j - 1  # inputs (x_{i+1}, f_i) for i = first .. T-2
        n = T - 1 - first
        if n <= 0 or (prev is not None and b not in prev):
            continue
        step.kept.append(b)
        pos = torch.arange(first, T - 1)
        step.ids.append(seq.token_ids[first + 1:])
        if prev is None and not regresses:
            step.hidden.append(head.combine_target_hidden(
                seq.features[:-1].to(device, head.fc.weight.dtype)))
        elif prev is None:
            feats = seq.features[:-1]
            noise = (torch.rand(feats.shape, generator=generator) * 2 - 1) * hp.feature_noise
            step.hidden.append((feats + noise).to(device))
        else:
            step.hidden.append(prev[b][:n])
        step.positions.append(pos)
        step.lens.append(n)
        reg_mask = pos >= seq.num_prompt_tokens - 1
        cls_mask = reg_mask & (pos <= T - 3)
        step.reg_rows.append(offset + reg_mask.nonzero().squeeze(1))
        step.cls_rows.append(offset + cls_mask.nonzero().squeeze(1))
        if regresses:
            step.reg_targets.append(seq.features[pos[reg_mask] + 1])
        step.teacher_ids.append(seq.teacher_ids[pos[cls_mask] + 1])
        step.teacher_probs.append(seq.teacher_probs[pos[cls_mask] + 1])
        offset += n
    return step


def _classification_loss(head: EagleDraftModel, hidden: torch.Tensor,
                         teacher_ids: torch.Tensor, teacher_probs: torch.Tensor,
                         vocab: LossVocab | None,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor | None]:
    """Cross-entropy of the head's next-token distribution against the teacher's top-k.

    Args:
        hidden: ``[n, H]`` the head's output at the label positions.
        teacher_ids / teacher_probs: ``[n, k]`` int64 / fp32 labels.
        vocab: the ids the softmax runs over (None: the whole vocabulary); teacher
            mass outside it is dropped and the rest renormalized.

    Returns:
        ``(loss, logprobs [n, V or C] fp32, teacher_ids [n, k] as indexes of the
        logprobs' columns, top_in_vocab [n] bool or None)``: ``top_in_vocab`` says
        whether the teacher's top id is a candidate at all.
    """
    top_in_vocab = None
    if vocab is None:
        logits = head.compute_logits(hidden)  # [n, V] fp32
    else:
        logits = (head.compute_draft_logits(hidden)[0] if head.cfg.has_own_lm_head
                  else F.linear(hidden.float(), vocab.lm_head))  # [n, C] fp32
        in_vocab = vocab.member[teacher_ids]  # [n, k]
        top_in_vocab = in_vocab[:, 0]
        teacher_probs = teacher_probs * in_vocab
        teacher_probs = teacher_probs / teacher_probs.sum(-1, keepdim=True).clamp_min(1e-12)
        teacher_ids = vocab.index[teacher_ids]
    logprobs = torch.log_softmax(logits, dim=-1)
    cls = -(teacher_probs * logprobs.gather(1, teacher_ids)).sum(-1).mean()
    return cls, logprobs, teacher_ids, top_in_vocab


def step_losses(head: EagleDraftModel, batch: Sequence[TargetFeatures], hp: TrainHyperParams,
                backend: PackedCausalAttention, generator: torch.Generator,
                vocab: LossVocab | None) -> tuple[torch.Tensor, float, float, float, int]:
    """Forward all unrolled steps of one batch.

    Returns:
        ``(loss, reg, cls, top1, num_tokens)``: the weighted loss (a 0-d tensor to
        backpropagate) and its regression and classification parts, each the mean over
        the unrolled steps; the first step's top-1 agreement with the teacher; the head
        tokens fed over all steps.
    """
    device = head.fc.weight.device
    prev: dict[int, torch.Tensor] | None = None
    total = torch.zeros((), device=device)
    reg_sum = cls_sum = 0.0
    top1 = 0.0
    num_tokens = 0
    for j in range(1, hp.unroll_steps + 1):
        step = _unrolled_step(head, batch, j, prev, hp, generator)
        if not step.lens:
            break
        out = head(torch.cat(step.ids).to(device), torch.cat(step.hidden),
                   torch.cat(step.positions).to(device), [(None, None)],
                   backend.build_metadata(step.lens))
        reg_idx = torch.cat(step.reg_rows).to(device)
        cls_idx = torch.cat(step.cls_rows).to(device)
        reg = (F.smooth_l1_loss(out[reg_idx], torch.cat(step.reg_targets).to(device))
               if head.cfg.predicts_target_features else out.new_zeros(()))
        cls, logprobs, teacher_ids, top_in_vocab = _classification_loss(
            head, out[cls_idx], torch.cat(step.teacher_ids).to(device),
            torch.cat(step.teacher_probs).to(device), vocab)
        total = total + hp.reg_weight * reg + hp.cls_weight * cls
        reg_sum += reg.item()
        cls_sum += cls.item()
        if j == 1:
            hit = logprobs.argmax(-1) == teacher_ids[:, 0]
            if top_in_vocab is not None:
                hit &= top_in_vocab
            top1 = float(hit.float().mean())
        num_tokens += sum(step.lens)
        # Step j + 1 feeds f̂_{i+1} (row i of this step) as the feature of position i + 1.
        prev, start = {}, 0
        for b, n in zip(step.kept, step.lens):
            prev[b] = out[start:start + n]
            start += n
    steps = max(1, hp.unroll_steps)
    return total / steps, reg_sum / steps, cls_sum / steps, top1, num_tokens
