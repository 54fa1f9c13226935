"""Offline acceptance estimate of an EAGLE head: greedy chain drafting on held-out answers.

For an answer the target produced greedily, its tokens are exactly what greedy
verification would accept. From a start position ``s`` (the target has produced ``f_s``
and ``x_{s+1}``) the head drafts ``k`` tokens in a chain, on its own predicted features,
through its paged KV cache as in serving; draft ``j`` is accepted when it and all earlier
drafts equal ``x_{s+1+j}``. Acceptance length = accepted drafts + 1 (the token the
target's verification pass adds). Every start attends to the true-feature K/V of the
context, like after a verification step; its chained K/V go to private copies of the
blocks they touch::

    shared blocks:   [ 0 | 1 | 2 | 3 ]        K/V of (x_{i+1}, f_i), i = 0 .. T-2
    start s = 37:    [ 0 | 1 | 2' | 3 ]       block 2' = copy of 2, chain writes 38, 39, 40
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pdserve.engine.attention.base import AttentionInputs
from pdserve.engine.spec_decode.eagle import EagleDraftModel
from pdserve.offline.eagle.features import TargetFeatures


@dataclass(frozen=True)
class AcceptanceEstimate:
    """Greedy chain-drafting statistics.

    Attributes:
        num_speculative_tokens: ``k``.
        num_starts: draft rounds simulated.
        mean_acceptance_length: mean of (accepted drafts + 1), in ``[1, k + 1]``.
        acceptance_rates: per draft position ``j = 1 .. k``, the fraction of rounds whose
            draft ``j`` was accepted given drafts ``1 .. j-1`` were.
        cumulative_rates: per ``j``, the fraction of rounds with at least ``j`` accepted.
    """

    num_speculative_tokens: int
    num_starts: int
    mean_acceptance_length: float
    acceptance_rates: tuple[float, ...]
    cumulative_rates: tuple[float, ...]

    def summary(self) -> str:
        """One line for humans."""
        rates = " ".join(f"{r:.2f}" for r in self.acceptance_rates)
        return (f"mean acceptance length {self.mean_acceptance_length:.2f} at k="
                f"{self.num_speculative_tokens} over {self.num_starts} draft rounds; "
                f"per-position acceptance {rates}")


def _slot(block_table: list[int], pos: int, block_size: int) -> int:
    return block_table[pos // block_size] * block_size + pos % block_size


@torch.inference_mode()
def _accepted_counts(head: EagleDraftModel, seq: TargetFeatures, k: int, block_size: int,
                     stride: int) -> torch.Tensor:
    """``[num_starts]`` int64 leading accepted drafts for each start of one sequence."""
    device = head.fc.weight.device
    dtype = head.fc.weight.dtype
    tokens = seq.token_ids.to(device)
    num_inputs = len(tokens) - 1  # head inputs (x_{i+1}, f_i), i = 0 .. T-2
    starts = list(range(max(seq.num_prompt_tokens - 1, 0), num_inputs - k, stride))
    if not starts:
        return torch.zeros(0, dtype=torch.int64)
    num_shared = (num_inputs + block_size - 1) // block_size
    num_blocks = num_shared + 2 * len(starts)
    cache_shape = (num_blocks, block_size, head.num_kv_heads, head.head_dim)
    kv = [(torch.zeros(cache_shape, dtype=dtype, device=device),
           torch.zeros(cache_shape, dtype=dtype, device=device))]
    shared = list(range(num_shared))
    positions = torch.arange(num_inputs, device=device)
    prefill = head.layer.self_attn.backend.build_metadata(AttentionInputs(
        slot_mapping=positions.clone(), query_lens=[num_inputs], seq_lens=[num_inputs],
        block_tables=[shared], num_decodes=0, block_size=block_size))
    first = head.combine_target_hidden(seq.features[:-1].to(device, dtype))  # eagle3: fc(aux)
    hidden = head(tokens[1:], first, positions, kv, prefill)

    tables = []
    for n, s in enumerate(starts):
        table = list(shared)
        for b, block in enumerate(sorted({(s + 1) // block_size, (s + k - 1) // block_size})):
            private = num_shared + 2 * n + b
            for cache in kv[0]:
                cache[private] = cache[block]
            table[block] = private
        tables.append(table)
    idx = torch.tensor(starts, device=device)
    hidden = hidden[idx]  # [n, H] step-1 drafts: predicted f_{s+1}
    accepted = []
    for j in range(1, k + 1):
        draft = head.compute_logits(hidden).argmax(-1)  # [n] draft j = guess of x_{s+1+j}
        accepted.append(draft == tokens[idx + 1 + j])
        if j == k:
            break
        pos = [s + j for s in starts]
        meta = head.layer.self_attn.backend.build_metadata(AttentionInputs(
            slot_mapping=torch.tensor([_slot(t, p, block_size) for t, p in zip(tables, pos)],
                                      dtype=torch.int64, device=device),
            query_lens=[1] * len(starts), seq_lens=[p + 1 for p in pos], block_tables=tables,
            num_decodes=len(starts), block_size=block_size))
        hidden = head(draft, hidden, torch.tensor(pos, device=device), kv, meta)
    return torch.stack(accepted, dim=1).long().cumprod(dim=1).sum(dim=1).cpu()


def estimate_acceptance(head: EagleDraftModel, data: Sequence[TargetFeatures],
                        num_speculative_tokens: int = 4, block_size: int = 16,
                        stride: int = 1) -> AcceptanceEstimate:
    """Simulate greedy chain drafting from every ``stride``-th answer position.

    Args:
        head: an EAGLE head built with a paged attention backend (e.g. ``torch``).
        data: held-out sequences whose answers are the target's greedy output.
        num_speculative_tokens: ``k`` drafts per round.
        block_size: tokens per block of the head's paged cache.
        stride: distance between simulated start positions.

    Raises:
        ValueError: no sequence has an answer longer than ``k + 1`` tokens.
    """
    k = num_speculative_tokens
    counts = [_accepted_counts(head, seq, k, block_size, stride) for seq in data]
    all_counts = torch.cat(counts) if counts else torch.zeros(0, dtype=torch.int64)
    if all_counts.numel() == 0:
        raise ValueError(f"no held-out answer is long enough for k={k} drafts")
    cumulative = tuple(float((all_counts >= j).float().mean()) for j in range(1, k + 1))
    rates = []
    for j in range(1, k + 1):
        reached = int((all_counts >= j - 1).sum())
        rates.append(float((all_counts >= j).sum()) / reached if reached else 0.0)
    return AcceptanceEstimate(k, int(all_counts.numel()),
                              float(all_counts.float().mean()) + 1.0, tuple(rates), cumulative)
