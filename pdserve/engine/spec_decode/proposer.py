"""The ``Proposer`` protocol for draft-token proposers, and the registry of implementations.

A proposer guesses the next ``k`` tokens of each running request; the target model then scores
all ``k + 1`` positions in one forward pass and the rejection sampler
(:mod:`pdserve.engine.spec_decode.rejection_sampler`) keeps the accepted prefix.

Model-free proposers (n-gram / prompt lookup) need only token histories, which is what
:meth:`Proposer.propose` takes. Model-based proposers will extend the protocol rather than
bend it:

- **EAGLE (EAGLE-1/2 heads, EAGLE-3)** also needs the target's hidden states at the last
  verified positions (EAGLE-3: several layers' states, concatenated) and keeps its own
  one-layer KV cache, so it needs the step's positions, slot mapping and the number of
  accepted tokens per request to roll its cache back.
- **Draft model** runs a smaller model of the same tokenizer with its own paged KV cache; it
  needs block tables / slot mappings for its cache and, for random sampling, returns the
  draft distribution ``q`` (``[k, V]`` fp32) with its tokens.

Both will be a ``ModelProposer`` protocol whose ``propose`` takes a typed per-step input
(token ids, hidden states, attention metadata) and returns a typed output (draft token ids
and optional draft probs). Point-mass proposers such as n-gram return no probs.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from pdserve.engine.spec_decode.ngram import NgramProposer


@runtime_checkable
class Proposer(Protocol):
    """Proposes draft tokens from token histories alone (no model state)."""

    def propose(
        self, requests_token_ids: list[list[int]], num_speculative_tokens: int
    ) -> list[list[int]]:
        """Drafts for a batch of requests.

        Args:
            requests_token_ids: per request its full history (prompt + output so far).
            num_speculative_tokens: k, the most draft tokens per request.

        Returns:
            Per request 0 .. k draft token ids, in order; an empty list means "no draft",
            and that request is verified like a plain decode step.
        """
        ...


#: Method name (``SpeculativeConfig.method``) -> proposer class. Read-only.
PROPOSERS: Mapping[str, type[Proposer]] = MappingProxyType({"ngram": NgramProposer})
