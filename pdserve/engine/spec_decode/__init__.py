"""Speculative decoding: draft proposers, the rejection sampler that verifies drafts, stats."""

from pdserve.engine.spec_decode.proposer import PROPOSERS, build_proposer, max_num_drafts
from pdserve.engine.spec_decode.stats import SpecDecodeStats

__all__ = ["PROPOSERS", "SpecDecodeStats", "build_proposer", "max_num_drafts"]
