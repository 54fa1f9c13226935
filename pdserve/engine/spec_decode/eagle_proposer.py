"""EAGLE drafting (Li et al. 2024, EAGLE-1/2; 2025, EAGLE-3) in the engine.

The head (:mod:`pdserve.engine.spec_decode.eagle`) extrapolates the target's features: at
position ``p`` it takes the token ``x_{p+1}`` and the target's feature at ``p`` and predicts
the feature of ``p + 1``, whose logits give the draft for ``p + 2``. After every target step
it ingests, for each request, the positions the step computed and the target accepted
(their features are in this step's hidden states), then chains on its own predicted
features for the remaining drafts.

Its one-layer K/V lives in the target's blocks (see :mod:`.model_proposer`). Positions the
head never saw with a target feature (a prefix-cache hit, a prompt whose K/V came from a
prefill worker) keep whatever those slots held: drafts get worse there, never the output.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.layers.linear import swap_to_fp32_gemm, wants_fp32_gemm
from pdserve.engine.request import Request
from pdserve.engine.spec_decode.eagle import load_eagle_model
from pdserve.engine.spec_decode.model_proposer import ModelProposer, _Draft


#: ``--speculative-model default``: the EAGLE head shipped for the embedded default model
#: (SmolLM2-135M-Instruct); how it was trained is in its README.md.
DEFAULT_EAGLE_HEAD = "default"


def eagle_head_path(name: str) -> Path:
    """The head folder ``--speculative-model`` names (``default``: the shipped one)."""
    if name == DEFAULT_EAGLE_HEAD:
        return Path(str(resources.files("pdserve.data").joinpath("eagle",
                                                                 "smollm2-135m-instruct")))
    return Path(name)


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
        super().__init__(config, runner, block_manager, max_model_len,
                         model.num_layers, model.num_kv_heads, model.head_dim)
        self.model = model
        self.target_aux_layer_ids = tuple(model.aux_layer_ids)  # eagle3: fused layers

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

    def _last_draft_position(self, request: Request, num_drafts: int) -> int:
        # ingest reaches position T - 2; drafts 1 .. n-1 are fed at T - 1 .. T + n - 3
        return request.num_tokens + num_drafts - 3

    def _ingest_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.combine_target_hidden(self.step_hidden.features[rows])

    def _forward(self, input_ids, positions, hidden, metadata) -> torch.Tensor:
        return self.model(input_ids, hidden, positions, self.kv_caches, metadata)

    def _chain_hidden(self, out_hidden: torch.Tensor) -> torch.Tensor:
        return out_hidden
