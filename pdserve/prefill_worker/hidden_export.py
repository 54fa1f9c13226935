"""The prompt hidden states a prefill worker sends with the KV, for decode workers' EAGLE heads.

An EAGLE head on the decode worker reads the target's features of every prompt position
(the final hidden states, or an EAGLE-3 head's fused layer inputs). They exist only on this
worker, one prefill chunk per step, and are gone after the step. :class:`PromptHiddenExport`
keeps each prompt's rows, cast to the wire dtype, until its prefill ends; the worker then
sends them after the KV layers as the transfer's hidden section
(:mod:`pdserve.kvtransfer.hidden`).

It takes the engine's proposer slot: the engine calls its proposer after every step with
the step's scheduled requests and hidden states, and runs the target with the proposer's
``target_aux_layer_ids`` (the SpecProposer protocol). It drafts nothing.
"""

from __future__ import annotations

import torch


class PromptHiddenExport:
    """Collects, per ``export_kv`` request, the features of the positions each step prefilled.

    Args:
        aux_layer_ids: the target layers an EAGLE-3 head fuses (their inputs are the
            features); empty: the final (normed) hidden states (EAGLE-1/2).
        hidden_size: the target model's hidden size.
        dtype: the dtype the rows are kept and sent in (bf16/fp16/fp32).

    Attributes:
        width: features per position, ``hidden_size * max(1, len(aux_layer_ids))``.
    """

    def __init__(self, aux_layer_ids: tuple[int, ...], hidden_size: int,
                 dtype: torch.dtype) -> None:
        self.target_aux_layer_ids = tuple(aux_layer_ids)
        self.width = hidden_size * max(1, len(self.target_aux_layer_ids))
        self.dtype = dtype
        # request id -> (first position, next position, row chunks) while it prefills
        self._partial: dict[str, tuple[int, int, list[torch.Tensor]]] = {}
        # request id -> (first position, [num_prompt_tokens - first, width]) once prefilled
        self._done: dict[str, tuple[int, torch.Tensor]] = {}

    def propose(self, sched, live_requests, step_hidden=None, allow_drafts: bool = True) -> None:
        """Keep this step's rows of every ``export_kv`` request (finished ones included: a
        prefill worker's request ends with the step that prefills its last chunk)."""
        if step_hidden is None:
            return
        for i, s in enumerate(sched.scheduled):
            req = s.request
            if not req.export_kv or s.num_new_tokens == 0:
                continue
            start = step_hidden.num_computed_before[i]
            end = start + s.num_new_tokens
            first, next_pos, chunks = self._partial.pop(req.request_id, (start, start, []))
            if next_pos != start:  # recomputed after a preemption: start over
                first, chunks = start, []
            row = step_hidden.query_starts[i]
            # [num_new_tokens, width], a copy (the step's tensor is not kept)
            chunks.append(step_hidden.features[row:row + s.num_new_tokens].to(
                device="cpu", dtype=self.dtype, copy=True))
            if end >= req.num_prompt_tokens:
                self._done[req.request_id] = (first, torch.cat(chunks))
            else:
                self._partial[req.request_id] = (first, end, chunks)

    def pop(self, request_id: str) -> tuple[int, torch.Tensor] | None:
        """``(hidden_start, [num_prompt_tokens - hidden_start, width])`` of a request whose
        prefill ended (``hidden_start`` > 0: its first positions were prefix-cache hits
        here), once; None if there is none. Forgets a request still prefilling."""
        self._partial.pop(request_id, None)
        return self._done.pop(request_id, None)

    def ingest_prompt(self, request, hidden, hidden_start: int, num_running: int) -> bool:
        """Part of the proposer protocol; a prefill worker ingests nothing: False."""
        return False
