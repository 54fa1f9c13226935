"""Engine configuration: one frozen, validated dataclass, plus the model's architecture facts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: dtype names accepted by ``EngineConfig.dtype``; "auto" picks bf16.
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}

#: ``EngineConfig.speculative_method`` values (see :mod:`pdserve.engine.spec_decode`).
SPECULATIVE_METHODS = ("none", "ngram", "draft", "eagle")
#: Running requests from which each speculative method drafts nothing by default
#: (``EngineConfig.speculative_disable_by_batch_size=None``): the batch size where its
#: tokens/s fell below plain decoding's (``bench/spec_decode.py``, SmolLM2 bf16, 2-core CPUs).
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE: dict[str, int] = {"eagle": 4, "draft": 2, "ngram": 4}
#: ``EngineConfig.num_speculative_tokens`` when none is given, per method (EAGLE: measured
#: with the shipped head on a 2-core Xeon with AMX; see README, "Speculative decoding").
DEFAULT_NUM_SPECULATIVE_TOKENS: dict[str, int] = {"eagle": 2, "draft": 4, "ngram": 4}

#: ``EngineConfig.kv_cache_dtype`` values: "auto" stores K/V in the compute dtype, "fp8" in
#: float8_e4m3fn with one fp32 scale per (layer, K/V, block, KV head), the KV wire format's.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn}

#: KV cache budget used on CPU when none is given.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3
#: Fraction of free accelerator memory given to the KV cache when none is given.
DEFAULT_GPU_KV_CACHE_FRACTION = 0.85


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start; validated on construction.

    KV cache size is given by at most one of ``num_kv_blocks`` (blocks),
    ``kv_cache_memory_bytes`` (bytes for all layers' K and V) or
    ``kv_cache_memory_fraction`` (of the device's free memory after the weights). None of
    them: 2 GiB on CPU, 85 % of free memory on CUDA. ``kv_cache_dtype="fp8"`` stores K/V as
    FP8 e4m3 (about half the bytes of bf16, so about twice the blocks for the same budget).
    ``enforce_eager`` runs every step through the eager model: no CUDA graphs for decode on
    CUDA, no fused decode kernel on CPU (:mod:`pdserve.engine.compiled.fused_decode`).

    ``quantization`` (None: as the checkpoint declares) names a weight quantization method
    of :mod:`pdserve.engine.quantization`; ``quantization_skip`` lists layer name patterns
    kept in 16-bit (``("lm_head", "layers.0")``).

    ``speculative_draft_confidence`` (model drafters only; 0 = off) ends a draft chain once
    the product of the drafter's probabilities of its tokens falls below it (EAGLE-2, Li et
    al. 2024, sec. 4.1: it approximates the chance that the target accepts the whole chain);
    the token that fell below is still proposed, and verification alone decides the output.

    ``num_speculative_tokens`` (None: :data:`DEFAULT_NUM_SPECULATIVE_TOKENS`) drafts per step.

    ``speculative_disable_by_batch_size`` (0 = never; None = the method's default in
    :data:`DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE`) drafts nothing in a step after which at least
    this many requests are running (a large batch already fills the GEMMs that made
    verification nearly free; vLLM's option of the same name). Model drafters still ingest
    the step's tokens. :attr:`spec_disable_batch_size` is the resolved value.

    ``speculative_adaptive`` (default on; :attr:`spec_adaptive` resolved): below the cap,
    :class:`~pdserve.engine.spec_decode.governor.SpecGovernor` drafts only where drafting
    measured more tokens/s (off with ``speculative_disable_by_batch_size=0``: always draft).

    Raises:
        ValueError: naming the field, for any invalid value.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    seed: int = 0
    attention_backend: str = "auto"
    load_progress: bool = True
    speculative_method: str = "none"
    num_speculative_tokens: int | None = None
    speculative_model: str | None = None
    speculative_draft_confidence: float = 0.0
    speculative_disable_by_batch_size: int | None = None
    speculative_adaptive: bool = True
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    quantization: str | None = None
    quantization_skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from pdserve.engine.quantization.registry import QUANTIZATION_CHOICES

        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if not isinstance(self.quantization_skip, tuple):
            raise ValueError("quantization_skip must be a tuple of layer name patterns")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        self._check_kv_cache()
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        self._check_speculation()

    def _check_kv_cache(self) -> None:
        budgets = [self.num_kv_blocks, self.kv_cache_memory_bytes, self.kv_cache_memory_fraction]
        if sum(b is not None for b in budgets) > 1:
            raise ValueError(
                "give at most one of num_kv_blocks, kv_cache_memory_bytes, kv_cache_memory_fraction"
            )
        for name in ("num_kv_blocks", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1], "
                             f"got {self.kv_cache_memory_fraction}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")

    def _check_speculation(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.speculative_method!r}")
        if self.num_speculative_tokens is None:  # the method's default
            object.__setattr__(self, "num_speculative_tokens",
                               DEFAULT_NUM_SPECULATIVE_TOKENS.get(self.speculative_method, 4))
        if not isinstance(self.num_speculative_tokens, int) or not (
                1 <= self.num_speculative_tokens <= 16):
            raise ValueError("num_speculative_tokens must be an integer in [1, 16], "
                             f"got {self.num_speculative_tokens!r}")
        if not (isinstance(self.speculative_draft_confidence, (int, float))
                and 0.0 <= self.speculative_draft_confidence < 1.0):
            raise ValueError("speculative_draft_confidence must be a number in [0, 1), "
                             f"got {self.speculative_draft_confidence!r}")
        if self.speculative_disable_by_batch_size is not None and (
                not isinstance(self.speculative_disable_by_batch_size, int)
                or self.speculative_disable_by_batch_size < 0):
            raise ValueError("speculative_disable_by_batch_size must be an integer >= 0 "
                             f"(0 = never), got {self.speculative_disable_by_batch_size!r}")
        needs_model = self.speculative_method in ("draft", "eagle")
        if self.speculative_draft_confidence > 0 and not needs_model:
            raise ValueError("speculative_draft_confidence applies to the model drafters "
                             f"(eagle, draft), not speculative_method="
                             f"{self.speculative_method!r}")
        if self.speculative_disable_by_batch_size and self.speculative_method == "none":
            raise ValueError("speculative_disable_by_batch_size needs a speculative_method "
                             "(eagle, draft or ngram); speculation is off")
        if needs_model and not self.speculative_model:
            raise ValueError(f"speculative_model is required for speculative_method="
                             f"{self.speculative_method!r}")
        if not needs_model and self.speculative_model:
            raise ValueError("speculative_model is only used with speculative_method "
                             "'draft' or 'eagle'")

    @property
    def use_speculation(self) -> bool:
        """True when a proposer drafts tokens for the decode steps."""
        return self.speculative_method != "none"

    @property
    def torch_device(self) -> torch.device:
        """:attr:`device` as a ``torch.device``."""
        return torch.device(self.device)

    @property
    def spec_disable_batch_size(self) -> int:
        """Running requests from which no drafts are made (0 = never): the configured
        ``speculative_disable_by_batch_size``, else the method's default."""
        if self.speculative_disable_by_batch_size is not None:
            return self.speculative_disable_by_batch_size
        return DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE.get(self.speculative_method, 0)

    @property
    def spec_adaptive(self) -> bool:
        """True when the measured-throughput governor decides drafting below the cap."""
        return (self.speculative_method != "none" and self.speculative_adaptive
                and self.spec_disable_batch_size != 0)

    def resolve_dtype(self) -> torch.dtype:
        """The compute dtype: the configured one, or bf16 for "auto"."""
        return DTYPES[self.dtype] or torch.bfloat16

    def resolve_kv_cache_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element dtype: ``compute_dtype`` for "auto", else float8_e4m3fn."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or compute_dtype


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture facts read from a Hugging Face ``config.json`` dict.

    Raises:
        ValueError: when a required field is missing or inconsistent.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    hf_config: dict = field(compare=False, repr=False)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "ModelArchConfig":
        """Read ``hf`` (defaults as transformers': KV heads = heads, head_dim = hidden /
        heads, ...); raises ValueError (see the class) when a required field is missing."""
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' field")
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
            cfg = cls(
                architecture=archs[0],
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", False)),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                bos_token_id=hf.get("bos_token_id"),
                hf_config=hf,
            )
        except KeyError as exc:
            raise ValueError(f"config.json is missing required field {exc.args[0]!r}") from None
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({cfg.num_heads}) must be a multiple of "
                f"num_key_value_heads ({cfg.num_kv_heads})"
            )
        return cfg

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V, all layers, for one token."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem
