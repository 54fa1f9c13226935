"""``train-eagle``'s settings (:class:`TrainEagleConfig`) and the checks that refuse a bad
run before any work is done: the ``--out`` folder, an ``--init-from`` head, and what can
only be checked against the target (:func:`check_fits_target`).
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.engine.spec_decode.eagle_config import (
    EAGLE_LAYOUTS,
    Eagle1Config,
    EagleConfig,
    eagle_config_class,
)
from pdserve.offline.eagle.trainer import TrainHyperParams

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
        layout: a name of :data:`~pdserve.engine.spec_decode.eagle_config.EAGLE_LAYOUTS`
            (eagle1: an EAGLE-1/2 head, eagle3: an EAGLE-3 head); see :attr:`head_kind`.
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
    layout: str = Eagle1Config.layout
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
        if self.aux_layer_ids and not self.head_kind.fuses_target_layers:
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
            _check_init_head(init_head_folder(self.init_from), self.head_kind)

    @property
    def head_kind(self) -> type[EagleConfig]:
        """The config class of ``layout`` (what the head to train is fed, whether it has
        its own LM head, ...)."""
        return eagle_config_class(self.layout)


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
    # whether it can really be written is probed when the run starts (probe_out_folder)


def probe_out_folder(out: Path) -> None:
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


def _head_kind(folder: Path) -> type[EagleConfig] | None:
    """The config class (layout) of the EAGLE head whose config is in ``folder`` (one
    decoder layer; see :class:`EagleConfig`), or None when it holds none."""
    try:
        cfg = EagleConfig.from_dir(folder)
    except (OSError, ValueError):
        return None
    return type(cfg) if cfg.hf_config.get("num_hidden_layers", 1) == 1 else None


def _is_eagle_head(folder: Path) -> bool:
    """Whether ``folder`` holds an EAGLE head's config (either layout)."""
    return _head_kind(folder) is not None


def init_head_folder(init_from: str | Path) -> Path:
    """The head folder ``--init-from`` names: ``default`` is the head shipped for the
    embedded default model (as for ``--speculative-model``), anything else a path."""
    from pdserve.engine.spec_decode.eagle_proposer import eagle_head_path

    return eagle_head_path(str(init_from)).expanduser()


def check_fits_target(cfg: TrainEagleConfig, model_path: Path,
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
        if cfg.head_kind.fuses_target_layers and init.aux_layer_ids:
            if aux and aux != tuple(init.aux_layer_ids):
                raise ValueError(f"aux_layer_ids {list(aux)} differ from the layers the "
                                 f"init_from head fuses ({list(init.aux_layer_ids)}); start a "
                                 "new head to fuse other layers")
            aux = tuple(init.aux_layer_ids)
    if aux and max(aux) >= arch.num_layers:
        raise ValueError(f"aux_layer_ids {list(aux)} are not layers of the target "
                         f"(0 .. {arch.num_layers - 1})")
    return width, aux


def _check_init_head(folder: Path, kind: type[EagleConfig]) -> None:
    """Refuse an ``init_from`` that is not an EAGLE head of layout ``kind`` before any work
    is done.

    Raises:
        FileNotFoundError: nothing there, or no config.json.
        ValueError: the config is not an EAGLE head's of that layout (e.g. a full model's).
    """
    if not folder.exists():
        raise FileNotFoundError(f"init_from {str(folder)!r} does not exist")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"init_from {str(folder)!r} is not an EAGLE head folder")
    found = _head_kind(folder)
    if found is not kind:
        held = f"; it holds an {found.layout} head" if found else ""
        raise ValueError(f"init_from {str(folder)!r} is not an {kind.name} head (train-eagle "
                         "continues from a head of the layout it trains, with one decoder "
                         f"layer, such as one it wrote{held})")
