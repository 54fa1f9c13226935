"""Model-based drafting (draft model, EAGLE head) over a paged KV cache of its own.

NOTE: the drafter's cache uses the TARGET's block ids: block ``b`` of the target cache and
block ``b`` of the drafter cache hold the same positions of the same request, so the block
manager, block tables and slot mappings serve both and preemption / abort / finish free
both at once. The drafter writes only slots at or past the request's computed tokens, which
the target overwrites (or has already written identically) when it verifies; the slots it
needs past the block table are reserved from the block manager when it proposes, and a
request gets fewer drafts (or none) when blocks are short.

One proposal, after a target step, for the requests that decode next (``T`` = tokens so far;
the last one was just sampled and has no K/V yet)::

    ingest : positions [a, b) in one varlen pass (catch up on accepted / new tokens)
    step 1 : the last ingested row's logits            -> d1
    step i : one token per request (d_{i-1}) at the next position -> d_i,   i = 2 .. n

Draft model: the token at position p is ``x_p``; ingestion ends at ``b = T`` so its last row
predicts position T. EAGLE: position p pairs ``x_{p+1}`` with the target's hidden state at
p; ingestion ends at ``b = T - 1`` (the last position with a target hidden state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention import AttentionInputs
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, ModelArchConfig
from pdserve.engine.loader.checkpoint import load_checkpoint
from pdserve.engine.loader.default_model import resolve_model
from pdserve.engine.request import Request
from pdserve.engine.sample.draws import draw_uniforms, greedy_tokens, sample_rows
from pdserve.engine.sample.sampling_metadata import SamplingMetadata
from pdserve.engine.sampling_params import GREEDY_TEMPERATURE
from pdserve.engine.spec_decode.proposer import max_num_drafts
from pdserve.engine.spec_decode.rejection_sampler import truncated_probs


@dataclass
class _Draft:
    """One request's work in a proposal."""

    request: Request
    num_drafts: int  # n, 0 = only ingest
    ingest_start: int  # a
    ingest_end: int  # b
    input_ids: list[int]  # tokens of positions [a, b)
    hidden_rows: list[int] | None  # EAGLE: rows of the step's target hidden for [a, b)


class ModelProposer:
    """Shared machinery of draft-model and EAGLE proposers; see the module docstring.

    Subclasses set ``model`` (with ``compute_logits``), implement :meth:`_plan_ingest`,
    :meth:`_last_draft_position` and :meth:`_forward`, and may override
    :meth:`_after_propose`.

    Args:
        config: the engine config (``num_speculative_tokens``).
        runner: the target's model runner (device, dtype, backend, RNG, last step's hidden).
        block_manager: the target's block manager (slots for the drafter are reserved here).
        max_model_len: the engine's context limit.
        num_layers, num_kv_heads, head_dim: the drafter's cache geometry.
    """

    def __init__(self, config: EngineConfig, runner, block_manager: BlockManager,
                 max_model_len: int, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.draft_confidence = config.speculative_draft_confidence
        self.runner = runner
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.block_size = block_manager.block_size
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], the target's blocks
        self.kv_cache = torch.zeros(
            (num_layers, 2, block_manager.num_blocks, self.block_size, num_kv_heads, head_dim),
            dtype=runner.dtype, device=runner.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(num_layers)]
        self.kv_cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        #: target layers whose inputs the drafter reads (EAGLE-3 sets them when built)
        self.target_aux_layer_ids: tuple[int, ...] = ()
        #: the hidden states of the step being ingested (set by :meth:`propose`)
        self.step_hidden = None

    # -- hooks -----------------------------------------------------------------------------
    def _plan_ingest(self, request: Request, sched_index: int | None) -> _Draft | None:
        """Positions ``[a, b)`` to ingest now and their inputs; None when nothing to do."""
        raise NotImplementedError

    def _last_draft_position(self, request: Request, num_drafts: int) -> int:
        """The last position whose drafter K/V ``num_drafts`` drafts write."""
        raise NotImplementedError

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 hidden: torch.Tensor | None, inputs: AttentionInputs) -> torch.Tensor:
        """``[N]`` ids/positions (+ ``[N, H]`` hidden for EAGLE) -> ``[N, H]`` drafter states;
        ``inputs``: the step's attention inputs (the drafter builds its own metadata)."""
        raise NotImplementedError

    def _ingest_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` inputs of the ingested rows of the last target step (EAGLE only)."""
        raise NotImplementedError

    def _chain_hidden(self, out_hidden: torch.Tensor) -> torch.Tensor | None:
        """What the next chained step takes as ``hidden`` (EAGLE: its own output)."""
        return None

    def _after_propose(self, draft: _Draft, tokens: list[int]) -> None:
        """Bookkeeping after ``draft.request`` got ``tokens``."""

    def ingest_prompt(self, request: Request, hidden, hidden_start: int, num_running: int) -> bool:
        """A remote prompt's hidden states: EAGLE's input (its override); others ignore them."""
        return False

    # -- the proposal ----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sched, live_requests: list[Request], step_hidden=None,
                allow_drafts: bool = True) -> None:
        """Ingest the step's new tokens and leave drafts on the decoding requests
        (``allow_drafts`` False: ingest only); ``step_hidden``: the step's
        :class:`~pdserve.engine.model_runner.StepHidden` (EAGLE reads it)."""
        self.step_hidden = step_hidden
        plans = self._plan(sched, live_requests, allow_drafts)
        if not plans:
            return
        # decodes (one query token) first: the attention backends' batch invariant
        plans.sort(key=lambda p: p.ingest_end - p.ingest_start != 1)
        out = self._run_ingest(plans)  # [len(plans), H]: each plan's last row
        drafting = [i for i, p in enumerate(plans) if p.num_drafts > 0]
        if not drafting:
            for p in plans:
                p.request.num_draft_computed = p.ingest_end
            return
        drafts = [plans[i] for i in drafting]
        hidden = out[torch.tensor(drafting, dtype=torch.int64, device=self.runner.device)]
        all_tokens, all_probs = self._draft_chains(drafts, hidden)
        for p in plans:
            p.request.num_draft_computed = p.ingest_end
        for plan, tokens, probs in zip(drafts, all_tokens, all_probs):
            plan.request.spec_token_ids = tokens
            is_random = len(probs) == len(tokens)
            plan.request.spec_draft_probs = torch.stack(probs) if is_random else None
            self._after_propose(plan, tokens)

    def _plan(self, sched, live_requests: list[Request], allow_drafts: bool) -> list[_Draft]:
        """What each live request ingests now and how many drafts it gets (slots reserved);
        a request without drafts ingests only the positions that have slots."""
        index = {s.request.request_id: i for i, s in enumerate(sched.scheduled)}
        plans: list[_Draft] = []
        for req in live_requests:
            plan = self._plan_ingest(req, index.get(req.request_id))
            if plan is None:
                continue
            plan.num_drafts = self._reserve(req, max_num_drafts(
                req, self.num_speculative_tokens, self.max_model_len)) if allow_drafts else 0
            if plan.num_drafts == 0:  # ingest only what has slots
                room = len(req.block_table) * self.block_size
                plan.ingest_end = min(plan.ingest_end, room)
                keep = plan.ingest_end - plan.ingest_start
                if keep <= 0:
                    continue
                plan.input_ids = plan.input_ids[:keep]
                if plan.hidden_rows is not None:
                    plan.hidden_rows = plan.hidden_rows[:keep]
            plans.append(plan)
        return plans

    def _draft_chains(self, drafts: list[_Draft], hidden: torch.Tensor,
                      ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Chain ``num_drafts`` tokens for each plan, from its ingested last row.

        Args:
            drafts: the plans that get drafts.
            hidden: ``[len(drafts), H]`` the drafter's state at each plan's last row.

        Returns:
            Per plan its draft tokens, and for a sampling request each token's ``q``
            (``[V]`` fp32; empty for a greedy one). A chain stops early when its
            confidence (the product of its tokens' draft probabilities) drops below
            ``draft_confidence``.
        """
        reqs = [d.request for d in drafts]
        smeta = SamplingMetadata.build(
            params=[r.sampling_params for r in reqs], prompt_token_ids=[[] for _ in reqs],
            output_token_ids=[[] for _ in reqs], generators=[r.generator for r in reqs],
            eos_token_id=None, vocab_size=self.runner.arch.vocab_size,
            device=self.runner.device)
        tokens, probs, chain_conf = self._sample(hidden, smeta)
        all_tokens = [[t] for t in tokens]
        all_probs = [[q] if q is not None else [] for q in probs]
        active = list(range(len(drafts)))  # indexes into drafts; rows of `hidden`
        for step in range(1, max(d.num_drafts for d in drafts)):
            still = [j for j in active if drafts[j].num_drafts > step
                     and (chain_conf is None or chain_conf[j] >= self.draft_confidence)]
            if not still:
                break
            row_of = {j: row for row, j in enumerate(active)}
            sel = torch.tensor([row_of[j] for j in still], dtype=torch.int64,
                               device=self.runner.device)
            active = still
            hidden = self._run_chain([drafts[j] for j in active],
                                     [all_tokens[j][-1] for j in active], step,
                                     self._chain_hidden(hidden[sel]))
            new_tokens, new_probs, conf = self._sample(hidden, _select_rows(smeta, active))
            for row, j in enumerate(active):
                all_tokens[j].append(new_tokens[row])
                if chain_conf is not None:
                    chain_conf[j] *= conf[row]
                if new_probs[row] is not None:
                    all_probs[j].append(new_probs[row])
        return all_tokens, all_probs

    def _reserve(self, req: Request, num_drafts: int) -> int:
        """Reserve slots for ``num_drafts`` drafts (fewer if blocks are short)."""
        bm = self.block_manager
        while num_drafts > 0:
            needed = self._last_draft_position(req, num_drafts) + 1 - req.num_computed_tokens
            if bm.can_append(req, needed):
                bm.append_slots(req, needed)
                return num_drafts
            num_drafts -= 1
        return 0

    def _slots(self, req: Request, positions: range | list[int]) -> list[int]:
        bs, bt = self.block_size, req.block_table
        return [bt[p // bs] * bs + p % bs for p in positions]

    def _run_ingest(self, plans: list[_Draft]) -> torch.Tensor:
        """One varlen pass over every plan's ``[a, b)``; returns each plan's last row."""
        dev = self.runner.device
        ids, positions, slots, hidden_rows, last_rows = [], [], [], [], []
        for p in plans:
            span = range(p.ingest_start, p.ingest_end)
            ids.extend(p.input_ids)
            positions.extend(span)
            slots.extend(self._slots(p.request, span))
            if p.hidden_rows is not None:
                hidden_rows.extend(p.hidden_rows)
            last_rows.append(len(ids) - 1)
        query_lens = [p.ingest_end - p.ingest_start for p in plans]
        inputs = AttentionInputs(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_lens=query_lens, seq_lens=[p.ingest_end for p in plans],
            block_tables=[p.request.block_table for p in plans],
            num_decodes=sum(1 for n in query_lens if n == 1),
            block_size=self.block_size)
        hidden = None
        if hidden_rows:
            hidden = self._ingest_hidden(torch.tensor(hidden_rows, dtype=torch.int64, device=dev))
        out = self._forward(torch.tensor(ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev), hidden, inputs)
        return out[torch.tensor(last_rows, dtype=torch.int64, device=dev)]

    def _run_chain(self, plans: list[_Draft], tokens: list[int], step: int,
                   hidden: torch.Tensor | None) -> torch.Tensor:
        """One token per request: draft ``step`` at the position after the previous one."""
        dev = self.runner.device
        positions = [self._last_draft_position(p.request, step + 1) for p in plans]
        slots = [self._slots(p.request, [pos])[0] for p, pos in zip(plans, positions)]
        inputs = AttentionInputs(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_lens=[1] * len(plans), seq_lens=[pos + 1 for pos in positions],
            block_tables=[p.request.block_table for p in plans], num_decodes=len(plans),
            block_size=self.block_size)
        return self._forward(torch.tensor(tokens, dtype=torch.int64, device=dev),
                             torch.tensor(positions, dtype=torch.int64, device=dev), hidden, inputs)

    def _sample(self, hidden: torch.Tensor, smeta: SamplingMetadata,
                ) -> tuple[list[int], list[torch.Tensor | None], list[float] | None]:
        """Draft tokens from the drafter's ``[R, H]`` states: argmax for greedy requests, else
        a sample from the truncated ``softmax(logits / T)``. Also returns per row
        ``q = softmax(logits / T)`` (``[V]`` fp32 over target ids, before truncation, as
        verification takes it) for sampling requests and None for greedy ones, and, when
        ``draft_confidence`` is on, each drafted token's probability under the drafter
        (``softmax(logits)`` for greedy rows, ``q`` for sampling rows; else None).

        A drafter with a draft vocabulary (``compute_draft_logits`` returning its target ids)
        is argmaxed over that vocabulary directly; sampling rows see ``-inf`` elsewhere."""
        draft_logits = getattr(self.model, "compute_draft_logits", None)
        if draft_logits is None:
            logits, ids = self.model.compute_logits(hidden), None
        else:
            logits, ids = draft_logits(hidden)
        if smeta.all_greedy:
            best = greedy_tokens(logits)
            conf = None
            if self.draft_confidence > 0:
                conf = logits.softmax(dim=-1).gather(1, best.unsqueeze(1)).squeeze(1).tolist()
            return (best if ids is None else ids[best]).tolist(), [None] * logits.shape[0], conf
        if ids is not None:
            full = logits.new_full((logits.shape[0], self.runner.arch.vocab_size), float("-inf"))
            full[:, ids] = logits
            logits = full
        is_greedy = smeta.temperature <= GREEDY_TEMPERATURE  # [R] bool
        temperature = torch.where(is_greedy, 1.0, smeta.temperature)
        scaled = logits / temperature.unsqueeze(1)
        q = scaled.softmax(dim=-1)  # [R, V] fp32
        rows = torch.arange(logits.shape[0], device=logits.device)
        truncated = truncated_probs(scaled, smeta, rows)
        uniforms = draw_uniforms(truncated.shape[0], smeta.generators,
                                 self.runner.default_generator, truncated.device)
        tokens = torch.where(is_greedy, greedy_tokens(logits), sample_rows(truncated, uniforms))
        conf = None
        if self.draft_confidence > 0:
            probs = (torch.where(is_greedy.unsqueeze(1), logits.softmax(dim=-1), q)
                     if bool(is_greedy.any()) else q)
            conf = probs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        return (tokens.tolist(), [None if g else row for g, row in zip(is_greedy.tolist(), q)],
                conf)


def _select_rows(smeta: SamplingMetadata, rows: list[int]) -> SamplingMetadata:
    """The metadata of a subset of rows (truncation and generators only; no processing)."""
    idx = torch.tensor(rows, dtype=torch.int64, device=smeta.temperature.device)
    pick = (lambda t: None if t is None else t[idx])
    remap = {old: new for new, old in enumerate(rows)}
    temperature = smeta.temperature[idx]
    return SamplingMetadata(
        temperature=temperature, all_greedy=bool((temperature <= 0).all()),
        all_random=bool((temperature > 0).all()), vocab_size=smeta.vocab_size,
        top_k=pick(smeta.top_k), top_p=pick(smeta.top_p), min_p=pick(smeta.min_p),
        generators={remap[r]: g for r, g in smeta.generators.items() if r in remap},
        penalties=None, logit_bias_row_ids=None, logit_bias_token_ids=None,
        logit_bias_values=None, min_tokens_row_ids=None, min_tokens_token_ids=None,
        max_num_logprobs=None)


class DraftModelProposer(ModelProposer):
    """A smaller model with the target's tokenizer drafts autoregressively.

    Its K/V lives in its own cache over the target's blocks (module NOTE). After a
    verification, draft K/V of accepted draft tokens stays valid: ``num_draft_computed``
    advances over the drafted tokens that the target accepted.

    Raises:
        FileNotFoundError: ``speculative_model`` does not exist.
        ValueError: its vocabulary size differs from the target's.
    """

    def __init__(self, config: EngineConfig, runner, block_manager: BlockManager,
                 max_model_len: int) -> None:
        from pdserve.engine.model_runner import load_model

        path = resolve_model(config.speculative_model)
        checkpoint = load_checkpoint(path)
        arch = ModelArchConfig.from_hf_config(checkpoint.hf_config)
        if arch.vocab_size != runner.arch.vocab_size:
            raise ValueError(
                f"speculative_model vocabulary ({arch.vocab_size}) differs from the target's "
                f"({runner.arch.vocab_size}); a draft model must share the tokenizer")
        if arch.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_model context ({arch.max_position_embeddings}) is shorter than "
                f"max_model_len ({max_model_len})")
        super().__init__(config, runner, block_manager, max_model_len,
                         arch.num_layers, arch.num_kv_heads, arch.head_dim)
        self.model = load_model(arch, checkpoint, runner.dtype, runner.device, runner.backend,
                                max_model_len, config.load_progress)
        self._written: dict[str, tuple[int, list[int]]] = {}

    def _plan_ingest(self, request: Request, sched_index: int | None) -> _Draft | None:
        start = request.num_draft_computed
        pending = self._written.pop(request.request_id, None)
        if pending is not None and pending[0] == start:
            # draft tokens written past `start` whose K/V is still right (they were accepted)
            for token in pending[1]:
                if start < request.num_tokens and request.token_ids[start] == token:
                    start += 1
                else:
                    break
        decoding = request.num_tokens - request.num_computed_tokens == 1
        end = request.num_tokens if decoding else request.num_computed_tokens
        if end <= start:
            return None
        return _Draft(request, 0, start, end, request.token_ids[start:end], None)

    def _last_draft_position(self, request: Request, num_drafts: int) -> int:
        # ingest reaches position T - 1; drafts 1 .. n-1 are written at T .. T + n - 2
        return request.num_tokens + num_drafts - 2

    def _forward(self, input_ids, positions, hidden, inputs) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches,
                          self.runner.backend.build_metadata(inputs))

    def _after_propose(self, draft: _Draft, tokens: list[int]) -> None:
        # K/V of tokens[:-1] is written at positions ingest_end ...
        self._written[draft.request.request_id] = (draft.ingest_end, tokens[:-1])

    def propose(self, sched, live_requests: list[Request], step_hidden=None,
                allow_drafts: bool = True) -> None:
        """Forget the written drafts of requests that are no longer live (finished or
        aborted), then propose as :meth:`ModelProposer.propose` does."""
        live = {r.request_id for r in live_requests}
        for request_id in [r for r in self._written if r not in live]:
            del self._written[request_id]  # finished or aborted
        super().propose(sched, live_requests, step_hidden, allow_drafts)
