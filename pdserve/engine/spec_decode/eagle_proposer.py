"""EAGLE drafting (Li et al. 2024, EAGLE-1/2; 2025, EAGLE-3) in the engine.

The head (:mod:`pdserve.engine.spec_decode.eagle`) extrapolates the target's features: at
position ``p`` it takes the token ``x_{p+1}`` and the target's feature at ``p`` and predicts
the feature of ``p + 1``, whose logits give the draft for ``p + 2``. After every target step
it ingests, for each request, the positions the step computed and the target accepted
(their features are in this step's hidden states), then chains on its own predicted
features for the remaining drafts.

Its one-layer K/V lives in the target's blocks (see :mod:`.model_proposer`). A prompt whose
K/V came from a prefill worker comes with its features (the transfer's hidden section), and
:meth:`EagleProposer.ingest_prompt` runs the head over it as a local prefill would. Positions
the head never saw with a target feature (a prefix-cache hit on blocks that arrived without
them, a transfer without a hidden section) keep whatever those slots held: drafts get worse
there, never the output.

While nothing is drafted (the batch-size cap, or the governor found drafting does not pay)
the head does not run: each request's new features wait in a stash (up to
:data:`MAX_STASH` positions, then they are ingested in one pass) and are ingested together
with the step that next drafts for it, so a step without drafts costs what it costs
without a head (the per-step ingest was ~10 % of a batch-1 step on a 2-core CPU).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels.cpu_gemv import swap_to_bf16_gemv
from pdserve.engine.layers.linear import swap_to_fp32_gemm, wants_fp32_gemm
from pdserve.engine.model_runner import StepHidden
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from pdserve.engine.spec_decode.eagle import load_eagle_model
from pdserve.engine.spec_decode.eagle_config import EagleConfig
from pdserve.engine.spec_decode.fused_eagle import FusedEagleLayer
from pdserve.engine.spec_decode.model_proposer import ModelProposer, _Draft

logger = logging.getLogger(__name__)


#: ``--speculative-model default``: the EAGLE head shipped for the embedded default model
#: (SmolLM2-135M-Instruct); how it was trained is in its README.md.
DEFAULT_EAGLE_HEAD = "default"


def eagle_head_path(name: str) -> Path:
    """The head folder ``--speculative-model`` names (``default``: the shipped one)."""
    if name == DEFAULT_EAGLE_HEAD:
        return Path(str(resources.files("pdserve.data").joinpath("eagle",
                                                                 "smollm2-135m-instruct")))
    return Path(name)


def eagle_feature_layers(name: str, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head ``name`` (``--speculative-model``) reads as
    its features (EAGLE-3; empty: the final hidden states), from its config.json alone (a
    prefill worker sending a prompt's features loads no head).

    Raises:
        FileNotFoundError / ValueError: no head folder there, or a bad config.json.
    """
    cfg = EagleConfig.from_dir(eagle_head_path(name))
    return tuple(type(cfg).resolve_aux_layer_ids(cfg.aux_layer_ids, num_target_layers))


#: Positions a request's stash holds before they are ingested anyway.
MAX_STASH = 256


@dataclass
class _Stash:
    """Target features of positions ``[start, start + len(features))`` not yet ingested."""

    start: int
    features: list[torch.Tensor]  # row blocks [n_i, F], in position order
    length: int = 0


class EagleProposer(ModelProposer):
    """Drafts with an EAGLE head on the target's features (``--speculative-method eagle``).

    Raises:
        FileNotFoundError / ValueError: the head folder is missing or does not fit the target.
    """

    def __init__(self, config: EngineConfig, runner, block_manager: BlockManager,
                 max_model_len: int) -> None:
        model = load_eagle_model(eagle_head_path(config.speculative_model), runner.model, runner.backend,
                                 max_model_len, runner.dtype)
        if wants_fp32_gemm(runner.device, runner.dtype):
            swap_to_fp32_gemm(model)  # as the target's layers (see layers/linear.py)
        elif runner.device.type == "cpu" and runner.dtype == torch.bfloat16:
            swap_to_bf16_gemv(model)  # decode-sized GEMMs at memory speed
        super().__init__(config, runner, block_manager, max_model_len,
                         model.num_layers, model.num_kv_heads, model.head_dim)
        self.model = model
        #: the head's layer in the fused CPU kernel for decode-sized steps, or None
        self.fused = (FusedEagleLayer.build(model, self.kv_cache)
                      if runner.device.type == "cpu" and runner.dtype == torch.bfloat16 else None)
        self.target_aux_layer_ids = tuple(model.aux_layer_ids)  # eagle3: fused layers
        self.disable_batch_size = config.spec_disable_batch_size  # 0: draft at any batch size
        self._stashes: weakref.WeakKeyDictionary[Request, _Stash] = weakref.WeakKeyDictionary()
        #: seconds the last proposal spent ingesting stashed positions before its drafts
        #: (what turning drafting back on costs, apart from drafting; the governor leaves
        #: it out of the drafting step's time)
        self.catch_up_s = 0.0

    def _plan(self, sched, live_requests: list[Request], allow_drafts: bool) -> list[_Draft]:
        """The base plans, except that a request getting no drafts stashes its new features
        instead of ingesting them (until :data:`MAX_STASH`), and one with a full stash
        ingests it with them; one getting drafts ingests its stash first, in a pass of its
        own timed as :attr:`catch_up_s` (see the module docstring)."""
        plans, extra, catch_up = [], [], []
        self.catch_up_s = 0.0
        for p in super()._plan(sched, live_requests, allow_drafts):
            stash = self._stashes.pop(p.request, None)
            if stash is not None and stash.start + stash.length != p.ingest_start:
                stash = None  # recomputed, or a gap: what the step ingests comes first
            if p.num_drafts == 0 and (stash is None or stash.length < MAX_STASH):
                stash = stash or _Stash(p.ingest_start, [])
                stash.features.append(self.step_hidden.features[
                    torch.tensor(p.hidden_rows, dtype=torch.int64)])
                stash.length += len(p.hidden_rows)
                self._stashes[p.request] = stash
                continue
            if stash is not None:  # ingest [stash.start, a) before (or with) the step's rows
                first = len(self.step_hidden.features) + sum(len(f) for f in extra)
                extra.extend(stash.features)
                rows = list(range(first, first + stash.length))
                ids = p.request.token_ids[stash.start + 1:p.ingest_start + 1]
                if p.num_drafts > 0:
                    catch_up.append(_Draft(p.request, 0, stash.start, p.ingest_start, ids, rows))
                else:
                    p.hidden_rows = rows + p.hidden_rows
                    p.ingest_start = stash.start
                    p.input_ids = ids + p.input_ids
            plans.append(p)
        if extra:
            self.step_hidden = dataclasses.replace(
                self.step_hidden, features=torch.cat([self.step_hidden.features, *extra]))
        if catch_up:
            start_s = time.perf_counter()
            catch_up.sort(key=lambda c: c.ingest_end - c.ingest_start != 1)  # as propose()
            self._run_ingest(catch_up)
            self.catch_up_s = time.perf_counter() - start_s
        return plans

    def _plan_ingest(self, request: Request, sched_index: int | None) -> _Draft | None:
        if sched_index is None:
            return None
        step = self.step_hidden
        computed_before = step.num_computed_before[sched_index]
        start = max(request.num_draft_computed, computed_before)
        end = request.num_computed_tokens  # target features exist for [.., end)
        if end <= start:
            return None
        first_row = step.query_starts[sched_index] + start - computed_before
        return _Draft(request, 0, start, end, request.token_ids[start + 1:end + 1],
                      list(range(first_row, first_row + end - start)))

    def ingest_prompt(self, request: Request, hidden: torch.Tensor, hidden_start: int,
                      num_running: int) -> bool:
        """Run the head over a remotely prefilled prompt as the step that prefilled it here
        would have: ingest positions ``[max(cached, hidden_start), num_prompt_tokens)`` (a
        local prefill skips its prefix-cache hits too), then draft unless ``num_running``
        (the engine's running requests) reached ``spec_disable_batch_size``.

        Args:
            request: just installed: its prompt computed, its first token appended.
            hidden: ``[num_prompt_tokens - hidden_start, F]`` the target features of prompt
                positions ``hidden_start ..`` (``F``: hidden_size, times the fused layers of
                EAGLE-3), any float dtype (cast to the model's).
            hidden_start: the first prompt position in ``hidden``.

        Returns:
            False, doing nothing, when ``hidden`` does not fit the request or this head (the
            head then lacks the prompt, as without it; the output is the same either way).
        """
        num_prompt = request.num_prompt_tokens
        width = self.runner.arch.hidden_size * max(1, len(self.target_aux_layer_ids))
        if (tuple(hidden.shape) != (num_prompt - hidden_start, width)
                or request.num_computed_tokens != num_prompt):
            logger.warning("request %s: prompt hidden states %s do not fit %d prompt tokens "
                           "from %d x %d features; the EAGLE head skips them",
                           request.request_id, tuple(hidden.shape), num_prompt, hidden_start,
                           width)
            return False
        start = max(request.num_cached_tokens, hidden_start, request.num_draft_computed)
        if start >= num_prompt:
            return True
        request.num_draft_computed = start
        # the prompt as one step whose hidden rows are positions start .. num_prompt - 1
        step = StepHidden(hidden[start - hidden_start:].to(self.runner.device, self.runner.dtype),
                          [0], [start])
        cap = self.disable_batch_size
        self.propose(SchedulerOutput([ScheduledRequest(request, num_prompt - start)]), [request],
                     step, allow_drafts=not cap or num_running < cap)
        return True

    def _last_draft_position(self, request: Request, num_drafts: int) -> int:
        # ingest reaches position T - 2; drafts 1 .. n-1 are fed at T - 1 .. T + n - 3
        return request.num_tokens + num_drafts - 3

    def _ingest_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.combine_target_hidden(self.step_hidden.features[rows])

    def _forward(self, input_ids, positions, hidden, inputs) -> torch.Tensor:
        if self.fused is not None and self.fused.can_run(input_ids.shape[0], hidden):
            return self.fused.run(input_ids, positions, hidden, inputs)
        return self.model(input_ids, hidden, positions, self.kv_caches,
                          self.runner.backend.build_metadata(inputs))

    def _chain_hidden(self, out_hidden: torch.Tensor) -> torch.Tensor:
        return out_hidden
