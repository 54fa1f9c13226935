"""Greedy outputs of the default model through `pdserve serve`, to compare two versions.

Runs 20 fixed chat prompts (greedy, 48 tokens, one at a time so every version sees the same
batches) through four configurations: colocated, disaggregated (prefill threshold 16, so
the prompts are prefilled on the prefill worker and their KV shipped), and both with the
shipped EAGLE head. Writes the texts as JSON; with ``--compare`` it reports every
difference against an earlier run and exits 1 if there is one. A refactor must leave the
bytes unchanged:

    git worktree add /tmp/before <old commit>
    PYTHONPATH=/tmp/before python bench/greedy_identity.py --out before.json
    python bench/greedy_identity.py --out after.json --compare before.json

(``PYTHONPATH`` puts the old tree's ``pdserve`` ahead of the installed one, for the server
and the workers it starts.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MODEL = "SmolLM2-135M-Instruct"
EAGLE = ("--speculative-method", "eagle", "--speculative-model", "default")
CONFIGS: dict[str, tuple[bool, tuple[str, ...]]] = {  # name -> (colocated, extra flags)
    "colocated": (True, ()),
    "disaggregated": (False, ("--prefill-threshold", "16")),
    "colocated-eagle": (True, EAGLE),
    "disaggregated-eagle": (False, ("--prefill-threshold", "16", *EAGLE)),
}
TOPICS = ("the moon", "bread", "a lighthouse", "rivers", "prime numbers", "autumn",
          "a library", "bees", "volcanoes", "the violin")
PROMPTS = [f"Write two sentences about {t}." for t in TOPICS] + [
    f"Explain to a child, step by step and in detail, how {t} came to be, what it is made "
    f"of, why people care about it, and one surprising fact about it." for t in TOPICS]


def run_config(colocated: bool, extra: tuple[str, ...], max_tokens: int) -> list[str]:
    from server_utils import ServerProcess  # noqa: PLC0415 (tests/ helper, path set above)

    srv = ServerProcess(*extra, colocated=colocated)
    try:
        texts = []
        with httpx.Client(timeout=300) as http:
            for prompt in PROMPTS:
                resp = http.post(f"{srv.base_url}/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "temperature": 0})
                resp.raise_for_status()
                texts.append(resp.json()["choices"][0]["message"]["content"])
        return texts
    finally:
        srv.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write the outputs to")
    p.add_argument("--compare", default=None, help="an earlier --out file to compare with")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--extra", default="", help="more `pdserve serve` flags for every "
                   "configuration, space-separated (e.g. --no-enable-prefix-caching)")
    args = p.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {sorted(CONFIGS)}")
    results = {}
    for name in names:
        start = time.monotonic()
        colocated, flags = CONFIGS[name]
        results[name] = run_config(colocated, (*flags, *args.extra.split()), args.max_tokens)
        print(f"{name}: {len(results[name])} outputs in {time.monotonic() - start:.0f} s",
              flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    if args.compare is None:
        return 0
    before = json.loads(Path(args.compare).read_text())
    num_diff = 0
    for name, texts in results.items():
        if name not in before:
            print(f"{name}: not in {args.compare}")
            continue
        for i, (old, new) in enumerate(zip(before[name], texts)):
            if old != new:
                num_diff += 1
                print(f"{name} prompt {i}: differs\n  before: {old!r}\n  after:  {new!r}")
        same = sum(a == b for a, b in zip(before[name], texts))
        print(f"{name}: {same}/{len(texts)} byte-identical")
    return 1 if num_diff else 0


if __name__ == "__main__":
    sys.exit(main())
