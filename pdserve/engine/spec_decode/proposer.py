"""What a draft proposer is, which requests it may draft for, and the registry of proposers.

A proposer runs after every engine step (``LLMEngine.step``): it sees the step's scheduled
requests and the step's hidden states (returned by the model runner) and leaves up to ``k``
draft tokens in ``request.spec_token_ids`` (plus ``request.spec_draft_probs`` when the
drafts were sampled from a distribution). The next step verifies them
(:mod:`pdserve.engine.spec_decode.rejection_sampler`).

Two kinds exist:

- history proposers (n-gram prompt lookup) need only token ids: :class:`TokenProposer`,
  wrapped by :class:`~pdserve.engine.spec_decode.history_proposer.HistoryProposer`;
- model proposers (a draft model, an EAGLE head) keep their own paged K/V in the target's
  blocks: :mod:`pdserve.engine.spec_decode.model_proposer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from pdserve.engine.request import Request

if TYPE_CHECKING:
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_runner import ModelRunner, StepHidden
    from pdserve.engine.scheduler import SchedulerOutput


@runtime_checkable
class TokenProposer(Protocol):
    """Proposes draft tokens from token histories alone (no model state)."""

    def propose(
        self, requests_token_ids: list[list[int]], num_speculative_tokens: int
    ) -> list[list[int]]:
        """Drafts for a batch of requests.

        Args:
            requests_token_ids: per request its full history (prompt + output so far).
            num_speculative_tokens: k, the most draft tokens per request.

        Returns:
            Per request 0 .. k draft token ids, in order; an empty list means "no draft".
        """
        ...


class SpecProposer(Protocol):
    """Leaves drafts on the requests after each engine step.

    Attributes:
        target_aux_layer_ids: target layers whose inputs the proposer reads as its features
            (EAGLE-3), fixed when it is built; empty: the target's final hidden states. The
            engine asks the model runner for them in every step.
    """

    target_aux_layer_ids: tuple[int, ...]

    def propose(self, sched: "SchedulerOutput", live_requests: list[Request],
                step_hidden: "StepHidden | None" = None, allow_drafts: bool = True) -> None:
        """Set ``spec_token_ids`` (and ``spec_draft_probs``) of ``live_requests``.

        Args:
            sched: the step that just ran (its requests' state is already updated).
            live_requests: the scheduled requests that did not finish in that step.
            step_hidden: that step's hidden states (the model runner's output).
            allow_drafts: False: draft nothing this step (a model drafter still ingests
                the step's tokens into its own cache).
        """
        ...

    def ingest_prompt(self, request: Request, hidden, hidden_start: int,
                      num_running: int) -> bool:
        """Take a remotely prefilled prompt's target hidden states (``[num_prompt_tokens -
        hidden_start, F]``, the features of positions ``hidden_start ..``), right after
        its KV was installed, so the drafter's state is what a local prefill leaves
        (EAGLE), and draft as after a step: only while ``num_running`` (the engine's running
        requests, this one included) is below ``spec_disable_batch_size``. Returns whether
        it used them (False: this proposer reads no hidden states, or they do not fit)."""
        ...


def max_num_drafts(request: Request, num_speculative_tokens: int, max_model_len: int) -> int:
    """How many draft tokens ``request`` may get now (0: decode it plainly).

    Zero while the request still prefills, when it uses logit processing that verification
    does not support (penalties, logit_bias, min_tokens not yet reached), and near its
    max_tokens / max_model_len limits (no draft beyond what it could still emit).
    """
    if request.num_tokens - request.num_computed_tokens != 1:
        return 0
    params = request.sampling_params
    if (params.has_penalties or params.logit_bias
            or request.num_output_tokens < params.min_tokens):
        return 0
    return max(0, min(num_speculative_tokens,
                      request.max_tokens - request.num_output_tokens - 1,
                      max_model_len - request.num_tokens))


ProposerFactory = Callable[["EngineConfig", "ModelRunner", "BlockManager", int], SpecProposer]


def _ngram(config, runner, block_manager, max_model_len) -> SpecProposer:
    from pdserve.engine.spec_decode.history_proposer import HistoryProposer
    from pdserve.engine.spec_decode.ngram import NgramProposer

    return HistoryProposer(NgramProposer(), config.num_speculative_tokens, max_model_len)


def _draft(config, runner, block_manager, max_model_len) -> SpecProposer:
    from pdserve.engine.spec_decode.model_proposer import DraftModelProposer

    return DraftModelProposer(config, runner, block_manager, max_model_len)


def _eagle(config, runner, block_manager, max_model_len) -> SpecProposer:
    from pdserve.engine.spec_decode.eagle_proposer import EagleProposer

    return EagleProposer(config, runner, block_manager, max_model_len)


#: ``EngineConfig.speculative_method`` -> factory ``(config, runner, block_manager,
#: max_model_len) -> SpecProposer``.
PROPOSERS: dict[str, ProposerFactory] = {"ngram": _ngram, "draft": _draft, "eagle": _eagle}


def build_proposer(config: "EngineConfig", runner: "ModelRunner",
                   block_manager: "BlockManager", max_model_len: int) -> SpecProposer | None:
    """The proposer ``config.speculative_method`` names, or None for "none".

    Raises:
        ValueError / FileNotFoundError: the draft model or head cannot be loaded or does
            not fit the target (e.g. a different vocabulary).
    """
    if not config.use_speculation:
        return None
    return PROPOSERS[config.speculative_method](config, runner, block_manager, max_model_len)
