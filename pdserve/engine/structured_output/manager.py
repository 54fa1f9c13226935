"""The engine's structured-output state: one grammar compiler, per-request matchers, masks.

Flow of one constrained request (``Request.grammar`` holds its matcher)::

    admitted ──► matcher at the grammar's start, fed any outputs it already has
        │        (a retry's tokens, the prefill worker's first token)
        ▼
    each step: bitmask row(s) filled for it ─► logits masked ─► token sampled/verified
        │        (a verified request gets one row per draft position: the state that
        │         draft prefix reaches, then rolled back)
        ▼
    emitted tokens consumed by the matcher; a grammar that has ended stops the request

Masks for step N are filled on a helper thread while step N's forward pass runs (they
depend only on tokens emitted up to step N - 1); the sampler waits for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.structured_output.backend import GrammarCompiler, GrammarMatcher
from pdserve.engine.structured_output.params import StructuredOutputParams

logger = logging.getLogger(__name__)


@dataclass
class StepMasks:
    """The bitmasks of one step; rows index the step's plain or verified logits rows."""

    plain_bitmask: torch.Tensor | None  # [R_p, W] int32, rows of plain_rows in order
    plain_rows: list[int]  # index into the step's plain (one-row) requests
    verify_bitmask: torch.Tensor | None  # [R_v, W] int32, rows of verify_rows in order
    verify_rows: list[int]  # index into the concatenated verified rows (k_i + 1 each)


class StructuredOutputManager:
    """Compiles grammars for one model and builds each step's token masks.

    The tokenizer and xgrammar's vocabulary tables are built on first use (about a
    second), so workers that never see a constrained request never pay for them.

    Args:
        tokenizer_path: what ``load_tokenizer`` reads (model folder or ``.gguf`` file).
        vocab_size: V, the width of the model's logits.
        stop_token_ids: the model's EOS ids (a completed grammar allows only these).
    """

    def __init__(self, tokenizer_path: str | Path, vocab_size: int,
                 stop_token_ids: list[int]) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        #: metrics: requests admitted per kind, seconds spent filling masks, compiles
        self.num_requests_by_kind: Counter[str] = Counter()
        self.mask_s = 0.0
        self.num_mask_steps = 0

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler, built on first use."""
        with self._lock:
            if self._compiler is None:
                from pdserve.engine.loader.checkpoint import load_tokenizer

                start = time.perf_counter()
                self._compiler = GrammarCompiler(load_tokenizer(self.tokenizer_path),
                                                 self.vocab_size, self.stop_token_ids)
                logger.info("grammar compiler ready in %.2f s",
                            time.perf_counter() - start)
            return self._compiler

    def new_matcher(self, params: StructuredOutputParams) -> GrammarMatcher:
        """A matcher for a newly admitted request.

        Raises:
            UnsupportedSchemaError, GrammarError: the spec does not compile.
        """
        matcher = self.compiler.new_matcher(params)
        self.num_requests_by_kind[params.kind.value] += 1
        return matcher

    @staticmethod
    def consume(matcher: GrammarMatcher, output_token_ids: list[int]) -> bool:
        """Feeds ``matcher`` the outputs it has not seen yet; False at a forbidden token."""
        for token_id in output_token_ids[matcher.num_consumed_tokens:]:
            if matcher.is_terminated or not matcher.accept_token(token_id):
                return False
        return True

    def submit_step_masks(self, plain: list[GrammarMatcher | None],
                          verify: list[tuple[GrammarMatcher | None, list[int]]]
                          ) -> Future[StepMasks] | None:
        """Starts filling this step's masks on the helper thread; None if nothing to mask.

        Args:
            plain: per plain request (one sampled row each), its matcher or None.
            verify: per verified request, its matcher or None and its draft token ids
                (it owns ``len(drafts) + 1`` consecutive verified rows).
        """
        if not any(m is not None for m in plain) and not any(m is not None for m, _ in verify):
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        return self._executor.submit(self._step_masks, plain, verify)

    def _step_masks(self, plain: list[GrammarMatcher | None],
                    verify: list[tuple[GrammarMatcher | None, list[int]]]) -> StepMasks:
        start = time.perf_counter()
        compiler = self.compiler
        plain_rows = [i for i, m in enumerate(plain) if m is not None]
        plain_bitmask = None
        if plain_rows:
            plain_bitmask = compiler.allocate_bitmask(len(plain_rows))
            for out_row, i in enumerate(plain_rows):
                plain[i].fill_bitmask(plain_bitmask, out_row)
        verify_rows: list[int] = []
        first = 0
        for matcher, drafts in verify:
            if matcher is not None:
                verify_rows.extend(range(first, first + len(drafts) + 1))
            first += len(drafts) + 1
        verify_bitmask = None
        if verify_rows:
            verify_bitmask = compiler.allocate_bitmask(len(verify_rows))
            out_row = 0
            for matcher, drafts in verify:
                if matcher is None:
                    continue
                out_row = self._fill_draft_rows(matcher, drafts, verify_bitmask, out_row)
        self.mask_s += time.perf_counter() - start
        self.num_mask_steps += 1
        return StepMasks(plain_bitmask, plain_rows, verify_bitmask, verify_rows)

    @staticmethod
    def _fill_draft_rows(matcher: GrammarMatcher, drafts: list[int], bitmask: torch.Tensor,
                         out_row: int) -> int:
        """Rows for positions 0..k: the state after each draft prefix, then rolled back.

        Once a draft is forbidden, the rows after it stay all-allowed: verification rejects
        that draft (its masked probability is 0), so they are never used.
        """
        matcher.fill_bitmask(bitmask, out_row)
        num_accepted = 0
        for j, token_id in enumerate(drafts):
            if matcher.is_terminated or not matcher.try_accept_token(token_id):
                break
            num_accepted += 1
            if not matcher.is_terminated:
                matcher.fill_bitmask(bitmask, out_row + j + 1)
        matcher.rollback(num_accepted)
        return out_row + len(drafts) + 1
