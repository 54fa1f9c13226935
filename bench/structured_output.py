"""Structured outputs' cost: W1-shaped batch throughput constrained vs free, and mask time.

Two parts, same run, same machine:

1. Offline engine: ``--batch`` requests (128-token random prompts, ``--output-len`` tokens,
   EOS ignored) decoded together, free and then under a 10-field JSON schema. Prints output
   tok/s of each, their ratio, and the grammar's mask time per step as a share of the step.
2. ``--http``: the same through ``pdserve serve`` with ``pdserve bench`` (W1: 32 requests at
   once), free and with ``response_format`` on every request, interleaved twice.

Usage::

    python bench/structured_output.py [--http] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.structured_output import StructuredOutputParams

#: W1's schema: ten required fields (strings bounded so a 64-token answer can close).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 24},
        "city": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "enum": ["FR", "DE", "US", "JP", "BR"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "notes": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "email", "city", "country", "tags", "score", "active", "zip",
                 "notes"],
}


def offline(batch: int, output_len: int, seed: int) -> dict:
    llm = LLM(None, load_progress=False)
    rng = random.Random(seed)
    vocab = len(llm.tokenizer)
    prompts = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(batch)]
    results = {}
    grammar = StructuredOutputParams.json_schema(SCHEMA)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4,
                                             structured_output=grammar))  # compile, warm up
    for label, constraint in (("free", None), ("json_schema", grammar),
                              ("free_2", None), ("json_schema_2", grammar)):
        manager = llm.engine.structured_output
        mask_s, mask_steps = manager.mask_s, manager.num_mask_steps
        steps = 0
        start = time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                                structured_output=constraint)
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(f"{label}-{i}", prompt, params)
        num_tokens = 0
        while llm.engine.has_unfinished_requests:
            num_tokens += sum(len(d.new_token_ids) for d in llm.engine.step())
            steps += 1
        wall = time.perf_counter() - start
        results[label] = {"tok_s": num_tokens / wall, "tokens": num_tokens, "steps": steps,
                          "step_ms": wall / steps * 1e3,
                          "mask_ms_per_step": (manager.mask_s - mask_s) * 1e3 /
                          max(1, manager.num_mask_steps - mask_steps)}
    for a, b in (("json_schema", "free"), ("json_schema_2", "free_2")):
        results[f"ratio_{a}"] = results[a]["tok_s"] / results[b]["tok_s"]
    return results


def _serve() -> tuple[subprocess.Popen, str]:
    port = 18000 + random.Random().randrange(1000)
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port)])
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("pdserve serve did not become healthy")


def http_w1(rounds: int) -> dict:
    proc, base = _serve()
    out: dict = {"free": [], "json_schema": [], "tokens": {"free": [], "json_schema": []}}
    extra = json.dumps({"response_format": {"type": "json_schema", "json_schema": {
        "name": "record", "schema": SCHEMA}}})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(rounds):
                for label, args in (("free", []), ("json_schema", ["--extra-body", extra])):
                    name = f"{label}-{r}.json"
                    subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "--base-url",
                                    base, "--dataset-name", "random", "--random-input-len",
                                    "128", "--random-output-len", "64", "--num-prompts", "32",
                                    "--ignore-eos", "--seed", str(r), "--save-result",
                                    "--result-dir", tmp, "--result-filename", name,
                                    "--disable-tqdm", *args], check=True,
                                   stdout=subprocess.DEVNULL)
                    result = json.loads((Path(tmp) / name).read_text())
                    out[label].append(result["output_throughput"])
                    out["tokens"][label].append(result["total_output_tokens"])
    finally:
        proc.terminate()
        proc.wait(60)
    out["ratio"] = sum(out["json_schema"]) / sum(out["free"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--http", action="store_true", help="also run W1 over HTTP")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {"cpu": platform.processor() or platform.machine(),
               "offline": offline(args.batch, args.output_len, args.seed)}
    off = results["offline"]
    for label in ("free", "json_schema", "free_2", "json_schema_2"):
        r = off[label]
        print(f"offline {label:14s} {r['tok_s']:7.1f} tok/s  step {r['step_ms']:6.1f} ms  "
              f"mask {r['mask_ms_per_step']:5.2f} ms/step")
    print(f"offline constrained/free: {off['ratio_json_schema']:.3f}, "
          f"{off['ratio_json_schema_2']:.3f}")
    if args.http:
        results["http_w1"] = http_w1(args.rounds)
        h = results["http_w1"]
        print(f"W1 over HTTP: free {h['free']} tok/s, json_schema {h['json_schema']} tok/s, "
              f"ratio {h['ratio']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
