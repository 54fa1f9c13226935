"""The target model's features and next-token distributions: the labels of EAGLE training.

For a sequence ``x_0 .. x_{T-1}`` the target gives features ``f_0 .. f_{T-1}`` (its final,
normed hidden states, ``f_i`` predicts ``x_{i+1}``) and next-token distributions
``p_i = softmax(lm_head(f_i))``. EAGLE (Li et al. 2024, sec. 4) regresses ``f_{i+1}``
and classifies against ``p_{i+1}`` from ``(x_{i+1}, f_i)``. ``p`` is kept as its top-k
(renormalized), which is all a cross-entropy against it needs in practice and keeps the
labels small: ``[T, k]`` ids and probabilities instead of ``[T, vocab]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from pdserve.engine.config import ModelArchConfig
from pdserve.engine.loader.checkpoint import load_checkpoint
from pdserve.engine.models import get_model_class
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.offline.eagle.data import DistillSequence
from pdserve.offline.eagle.packed_attention import PackedCausalAttention

#: Teacher probabilities kept per position.
TEACHER_TOP_K = 8


def load_target_model(path: str | Path, max_position: int, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", backend=None) -> LlamaForCausalLM:
    """Load a model the engine serves, with ``backend`` (default: packed causal, no KV cache).

    Raises:
        FileNotFoundError / ValueError: as :func:`load_checkpoint` and ``load_weights``.
    """
    checkpoint = load_checkpoint(path)
    arch = ModelArchConfig.from_hf_config(checkpoint.hf_config)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = get_model_class(arch.architecture)(
                arch, backend or PackedCausalAttention(), max_position)
    finally:
        torch.set_default_dtype(old)
    model.load_weights(checkpoint.iter_weights(dtype, progress=False))
    return model.eval().requires_grad_(False)


@dataclass
class TargetFeatures:
    """Labels of one sequence.

    Attributes:
        token_ids: ``[T]`` int64, prompt then answer.
        features: ``[T, H]`` fp32, the target's final normed hidden states; for an EAGLE-3
            head ``[T, 3 * H]`` bf16, the inputs of its ``aux_layer_ids`` layers (low, mid,
            high; bf16 halves the largest part of the training data).
        teacher_ids: ``[T, k]`` int64, top-k next-token ids of each position ``>= P - 1``
            (zero before).
        teacher_probs: ``[T, k]`` fp32, their probabilities renormalized to sum to 1
            (zero before ``P - 1``).
        num_prompt_tokens: ``P``; positions ``>= P - 1`` predict answer tokens.
        is_held_out: evaluation sequence.
    """

    token_ids: torch.Tensor
    features: torch.Tensor
    teacher_ids: torch.Tensor
    teacher_probs: torch.Tensor
    num_prompt_tokens: int
    is_held_out: bool


@torch.inference_mode()
def compute_target_features(target: LlamaForCausalLM, sequences: Sequence[DistillSequence],
                            batch_tokens: int = 4096, use_tqdm: bool = True,
                            desc: str = "target features",
                            aux_layer_ids: tuple[int, ...] = ()) -> list[TargetFeatures]:
    """Run the target over each prompt + answer (packed batches of about ``batch_tokens``).

    Args:
        target: a model built with :class:`PackedCausalAttention` (see
            :func:`load_target_model`).
        sequences: prompts with the target's answers.
        batch_tokens: tokens per forward pass.
        use_tqdm, desc: show a progress bar with this label.
        aux_layer_ids: EAGLE-3: keep these layers' inputs (bf16) as the features instead of
            the final hidden states (see :meth:`~pdserve.engine.models.llama.LlamaModel.forward`).

    Returns:
        One :class:`TargetFeatures` per sequence, in order, on the CPU.
    """
    device = next(target.parameters()).device
    backend = target.model.layers[0].self_attn.backend
    kv_caches = [(None, None)] * len(target.model.layers)
    out: list[TargetFeatures] = []
    batches: list[list[DistillSequence]] = [[]]
    for seq in sequences:
        if batches[-1] and sum(len(s.prompt_ids) + len(s.answer_ids)
                               for s in batches[-1]) >= batch_tokens:
            batches.append([])
        batches[-1].append(seq)
    for batch in tqdm(batches, desc=desc, disable=not use_tqdm):
        ids = [s.prompt_ids + s.answer_ids for s in batch]
        flat = torch.tensor([t for seq_ids in ids for t in seq_ids], dtype=torch.int64,
                            device=device)
        positions = torch.cat([torch.arange(len(x), device=device) for x in ids])
        meta = backend.build_metadata([len(x) for x in ids])
        if aux_layer_ids:
            hidden, aux = target(flat, positions, kv_caches, meta, tuple(aux_layer_ids))
        else:
            hidden = aux = target(flat, positions, kv_caches, meta)
        start = 0
        for seq, seq_ids in zip(batch, ids):
            rows = slice(start, start + len(seq_ids))
            feats = hidden[rows]
            start += len(seq_ids)
            kept = (aux[rows].to("cpu", torch.bfloat16) if aux_layer_ids
                    else feats.float().cpu()).clone()
            # Only positions >= P - 1 are ever labels; earlier rows stay zero.
            first = max(len(seq.prompt_ids) - 1, 0)
            probs = torch.softmax(target.compute_logits(feats[first:]), dim=-1)  # [., V] fp32
            top_probs, top_ids = probs.topk(TEACHER_TOP_K, dim=-1)
            teacher_ids = torch.zeros(len(seq_ids), TEACHER_TOP_K, dtype=torch.int64)
            teacher_probs = torch.zeros(len(seq_ids), TEACHER_TOP_K)
            teacher_ids[first:] = top_ids.cpu()
            teacher_probs[first:] = (top_probs / top_probs.sum(-1, keepdim=True)).cpu()
            out.append(TargetFeatures(
                # clone: a view would keep (and save) the whole batch's hidden states
                torch.tensor(seq_ids, dtype=torch.int64), kept, teacher_ids,
                teacher_probs, len(seq.prompt_ids), seq.is_held_out))
        release_freed_memory()
    return out


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Each batch allocates ``[rows, vocab]`` fp32 logits of a different size; glibc keeps
    the freed pieces, and over thousands of sequences the process grew by ~12 KB per
    token (a 2,800-sequence run was killed at 15 GB) while the features kept are 2.3 KB
    per token.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
