"""Adapter running a token-history proposer (n-gram) as the engine's step proposer."""

from __future__ import annotations

from pdserve.engine.request import Request
from pdserve.engine.spec_decode.proposer import TokenProposer, max_num_drafts


class HistoryProposer:
    """Drafts from token histories only; nothing to keep in the KV cache.

    Args:
        proposer: e.g. :class:`~pdserve.engine.spec_decode.ngram.NgramProposer`.
        num_speculative_tokens: k.
        max_model_len: the engine's context limit.
    """

    def __init__(self, proposer: TokenProposer, num_speculative_tokens: int,
                 max_model_len: int) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.target_aux_layer_ids: tuple[int, ...] = ()

    def ingest_prompt(self, request: Request, hidden, hidden_start: int,
                      num_running: int) -> bool:
        """Ignored (drafts come from tokens alone): returns False."""
        return False

    def propose(self, sched, live_requests: list[Request], step_hidden=None,
                allow_drafts: bool = True) -> None:
        """Point-mass drafts (``spec_draft_probs`` None) for every decoding request."""
        if not allow_drafts:
            return
        drafting = [(r, n) for r in live_requests
                    if (n := max_num_drafts(r, self.num_speculative_tokens,
                                            self.max_model_len)) > 0]
        if not drafting:
            return
        drafts = self.proposer.propose([r.token_ids for r, _ in drafting],
                                       self.num_speculative_tokens)
        for (req, n), tokens in zip(drafting, drafts):
            req.spec_token_ids = tokens[:n]
            req.spec_draft_probs = None
