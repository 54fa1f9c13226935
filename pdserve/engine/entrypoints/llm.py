"""Offline batch generation: ``LLM(model).generate(prompts, SamplingParams)``."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader.checkpoint import load_tokenizer
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """An engine plus its tokenizer, for offline use and tests.

    Args:
        model: a model folder, a ``.gguf`` file, or None for the embedded default model.
        **config: any :class:`EngineConfig` field (``dtype``, ``block_size``, ...).

    Raises:
        FileNotFoundError / ValueError: as :class:`LLMEngine`.
    """

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self._init(EngineConfig(model=model, **config))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """Build from an already validated :class:`EngineConfig`."""
        llm = cls.__new__(cls)
        llm._init(config)
        return llm

    def _init(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._tokenizer = None
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        """The model's transformers tokenizer, loaded on first use."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.engine.model_path)
        return self._tokenizer

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` under the model's chat template, generation prompt added."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, detokenize: bool = True,
                 desc: str = "generate") -> list[RequestOutput]:
        """Generate for every prompt, batched by the engine; results in prompt order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one for all prompts or one per prompt (default: greedy-less
                ``SamplingParams()``).
            use_tqdm: show a progress bar over finished requests.
            detokenize: fill ``CompletionOutput.text`` (loads the tokenizer).
            desc: the progress bar's label.

        Raises:
            ValueError: bad prompt or parameters (see :meth:`LLMEngine.add_request`).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("sampling_params must be one value or one per prompt")

        results: list[RequestOutput] = []
        sub_ids: dict[str, tuple[int, int]] = {}
        try:
            self._add_all(prompts, params_list, results, sub_ids)
        except Exception:
            for sub_id in sub_ids:  # leave nothing queued behind a bad prompt
                self.engine.abort_request(sub_id)
            raise

        bar = tqdm(total=len(sub_ids), disable=not use_tqdm, desc=desc)
        while self.engine.has_unfinished_requests:
            for delta in self.engine.step():
                i, j = sub_ids[delta.request_id]
                comp = results[i].outputs[j]
                comp.token_ids.extend(delta.new_token_ids)
                if delta.new_logprobs is not None:
                    comp.logprobs = (comp.logprobs or []) + list(delta.new_logprobs)
                if delta.prompt_logprobs is not None and j == 0:
                    results[i].prompt_logprobs = list(delta.prompt_logprobs)
                if delta.finished:
                    comp.finish_reason = delta.finish_reason
                    results[i].num_cached_tokens = delta.num_cached_tokens
                    bar.update(1)
        bar.close()
        if detokenize:
            for res in results:
                for comp in res.outputs:
                    comp.text = self.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
        return results

    def _add_all(self, prompts: Sequence[Prompt], params_list: list[SamplingParams],
                 results: list[RequestOutput], sub_ids: dict[str, tuple[int, int]]) -> None:
        """Queue every prompt (``n`` sub-requests each), recording where outputs go."""
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = str(next(self._ids))
            results.append(RequestOutput(
                rid, prompt if isinstance(prompt, str) else None, ids,
                [CompletionOutput(j) for j in range(params.n)],
            ))
            for j in range(params.n):
                sub = params if params.n == 1 else dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + j)
                sub_id = f"{rid}-{j}"
                self.engine.add_request(sub_id, ids, sub)
                sub_ids[sub_id] = (i, j)
