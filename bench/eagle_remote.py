"""EAGLE on remotely prefilled prompts: acceptance length remote vs local, same run (issue 22).

Long chat prompts (a held-out Brown-corpus passage, which pdserve's EAGLE training never
reads, and a request to summarize it; >= 600 tokens, above ``--prefill-threshold``), greedy,
one at a time, through real ``pdserve serve`` processes with the shipped head
(``--speculative-method eagle --speculative-model default``), float32:

    local           serve --colocated: the decode worker prefills the prompt itself
    remote[-DTYPE]  serve, 1 prefill + 1 decode worker, --prefill-threshold 512: the prompt is
                    prefilled on the prefill worker; its KV (fp8) and its hidden states
                    (--kv-transfer-hidden-dtype DTYPE, default bfloat16) cross the wire
    remote-none     the same without hidden states (the head has no prompt entries: before)
    remote-exact[-DTYPE]  the same with the exact KV wire (--kv-transfer-dtype auto): the
                    answers are the colocated ones, so acceptance compares like with like
    plain-local, plain-remote: no speculation, the greedy reference of each path

Per configuration: the mean acceptance length (1 + accepted / drafts, from the server's
``pdserve:spec_decode_*`` counters, read after each prompt), its ratio to ``local``, whether
every answer equals the non-speculative one of the same path, and the KV transfer bytes
per prompt token (``pdserve:kv_transfer_bytes``), whose growth over ``remote-none`` is the
hidden section's share::

    python bench/eagle_remote.py [--num-prompts 12] [--max-tokens 96]
        [--configs plain-local,local,plain-remote,remote,remote-none,remote-float16,...]
        [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MODEL = "SmolLM2-135M-Instruct"
EAGLE = ("--speculative-method", "eagle", "--speculative-model", "default",
         "--no-speculative-adaptive")  # acceptance of drafting every step, not the governor's mix
REMOTE = ("--prefill-threshold", "512")
BASE = ("--dtype", "float32")
#: the prompt's words around a passage (the passage is cut to make the prompt this long)
MIN_PROMPT_TOKENS = 600


def config_flags(name: str) -> tuple[bool, tuple[str, ...]]:
    """``(colocated, serve flags)`` of a configuration name (see the module docstring)."""
    if name == "plain-local":
        return True, BASE
    if name == "local":
        return True, BASE + EAGLE
    if name == "plain-remote":
        return False, BASE + REMOTE
    if name.startswith("remote-exact"):  # exact KV wire: the same answers as colocated
        dtype = name.removeprefix("remote-exact").removeprefix("-") or "bfloat16"
        return False, BASE + REMOTE + EAGLE + ("--kv-transfer-dtype", "auto",
                                               "--kv-transfer-hidden-dtype", dtype)
    if name.startswith("remote"):
        dtype = name.partition("-")[2] or "bfloat16"
        return False, BASE + REMOTE + EAGLE + ("--kv-transfer-hidden-dtype", dtype)
    raise ValueError(f"unknown configuration {name!r}")


def long_prompts(num_prompts: int, num_passage_tokens: int = 620) -> list[str]:
    """User messages: a held-out Brown passage of ``num_passage_tokens`` tokens and a
    request to summarize it (the chat prompt is then >= 600 tokens)."""
    from transformers import AutoTokenizer

    from pdserve.engine.loader.default_model import resolve_model
    from pdserve.offline.eagle.data import (fetch_brown_corpus, read_brown_files,
                                            split_brown_files)

    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    files = read_brown_files(fetch_brown_corpus())
    _, held_out = split_brown_files(list(files))
    out = []
    for name in held_out:
        ids = tok.encode(" ".join(files[name]))
        if len(ids) >= num_passage_tokens:
            passage = tok.decode(ids[:num_passage_tokens])
            out.append(f"Read this passage:\n\n{passage}\n\nSummarize it in a few sentences.")
        if len(out) == num_prompts:
            return out
    raise ValueError(f"only {len(out)} held-out files have {num_passage_tokens} tokens")


def _counters(server) -> dict[str, float]:
    """Spec-decode and KV-transfer totals of ``server`` (model-wide series only)."""
    from server_utils import metrics  # noqa: PLC0415 (tests/ helper, path set above)

    m = metrics(server)
    names = ("pdserve:spec_decode_num_drafts_total",
             "pdserve:spec_decode_num_accepted_tokens_total",
             "pdserve:kv_transfer_bytes_total", "pdserve:prompt_tokens_total")
    out = {n: m.get(n + "{}", 0.0) for n in names}
    out["remote"] = m.get("pdserve:route_decisions_total{route=remote_prefill}", 0.0)
    return out


def settled_counters(server, quiet_s: float = 1.3, timeout_s: float = 15.0) -> dict:
    """The counters once two readings ``quiet_s`` apart agree (workers report their
    spec-decode counts in heartbeats, once a second)."""
    deadline = time.monotonic() + timeout_s
    last = _counters(server)
    while True:
        time.sleep(quiet_s)
        now = _counters(server)
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def run_config(name: str, prompts: list[str], max_tokens: int) -> dict:
    """Serve ``name``, send every prompt (greedy, one at a time) and read the counters
    after each; returns answers, per-prompt drafts / accepted tokens, bytes and time."""
    from server_utils import ServerProcess  # noqa: PLC0415

    colocated, flags = config_flags(name)
    t0 = time.perf_counter()
    srv = ServerProcess(*flags, colocated=colocated)
    startup_s = time.perf_counter() - t0
    try:
        before = settled_counters(srv)
        rows = []
        with httpx.Client(timeout=600) as http:
            for prompt in prompts:
                t = time.perf_counter()
                resp = http.post(f"{srv.base_url}/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "temperature": 0})
                resp.raise_for_status()
                body = resp.json()
                seconds = time.perf_counter() - t
                after = settled_counters(srv)
                rows.append({
                    "text": body["choices"][0]["message"]["content"],
                    "prompt_tokens": body["usage"]["prompt_tokens"],
                    "completion_tokens": body["usage"]["completion_tokens"],
                    "seconds": seconds,
                    **{k.removeprefix("pdserve:").removesuffix("_total"): after[k] - before[k]
                       for k in after}})
                before = after
    finally:
        srv.stop()
    return {"name": name, "flags": list(flags), "colocated": colocated,
            "startup_s": startup_s, "prompts": rows}


def summarize(run: dict) -> dict:
    """Acceptance length over all prompts, per prompt, and KV bytes per prompt token."""
    rows = run["prompts"]
    drafts = sum(r["spec_decode_num_drafts"] for r in rows)
    accepted = sum(r["spec_decode_num_accepted_tokens"] for r in rows)
    remote_tokens = sum(r["prompt_tokens"] for r in rows if r["remote"])
    kv_bytes = sum(r["kv_transfer_bytes"] for r in rows)
    return {
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "num_drafts": drafts, "num_accepted": accepted,
        "per_prompt_acceptance": [1 + r["spec_decode_num_accepted_tokens"]
                                  / r["spec_decode_num_drafts"]
                                  if r["spec_decode_num_drafts"] else None for r in rows],
        "num_remote": sum(1 for r in rows if r["remote"]),
        "kv_bytes_per_prompt_token": kv_bytes / remote_tokens if remote_tokens else None,
        "min_prompt_tokens": min(r["prompt_tokens"] for r in rows),
        "decode_s": sum(r["seconds"] for r in rows),
    }


def report(runs: dict[str, dict]) -> dict:
    """Summaries, ratios to ``local``, identity to the plain runs, and the hidden bytes."""
    summary = {name: summarize(run) for name, run in runs.items()}
    texts = {name: [r["text"] for r in run["prompts"]] for name, run in runs.items()}
    local = summary.get("local", {}).get("acceptance_length")
    for name, s in summary.items():
        exact = name.startswith("remote-exact")
        plain = "plain-local" if runs[name]["colocated"] or exact else "plain-remote"
        none_bytes = summary.get("remote-exact-none" if exact else "remote-none",
                                 {}).get("kv_bytes_per_prompt_token")
        if plain in texts and name != plain:
            s["same_text_as_" + plain] = texts[name] == texts[plain]
            s["num_differing_texts"] = sum(a != b for a, b in zip(texts[name], texts[plain]))
        if local and s["acceptance_length"]:
            s["ratio_to_local"] = s["acceptance_length"] / local
        if none_bytes and s["kv_bytes_per_prompt_token"] and not name.endswith("-none"):
            extra = s["kv_bytes_per_prompt_token"] - none_bytes
            s["hidden_bytes_per_prompt_token"] = extra
            s["hidden_share_of_kv_bytes"] = extra / none_bytes
    return summary


def print_table(summary: dict) -> None:
    """One line per configuration."""
    print(f"{'config':16} {'accept':>7} {'ratio':>6} {'remote':>6} {'same text':>9} "
          f"{'B/tok':>8} {'hidden B/tok':>12} {'share':>6}")
    for name, s in summary.items():
        same = [v for k, v in s.items() if k.startswith("same_text_as_")]

        def fmt(v, f):
            return "-" if v is None else format(v, f)

        print(f"{name:16} {fmt(s['acceptance_length'], '.3f'):>7} "
              f"{fmt(s.get('ratio_to_local'), '.3f'):>6} {s['num_remote']:>6} "
              f"{('yes' if same[0] else 'NO') if same else '-':>9} "
              f"{fmt(s['kv_bytes_per_prompt_token'], '.0f'):>8} "
              f"{fmt(s.get('hidden_bytes_per_prompt_token'), '.0f'):>12} "
              f"{fmt(s.get('hidden_share_of_kv_bytes'), '.3f'):>6}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--configs", default="plain-local,local,plain-remote,remote,remote-none,"
                                        "remote-float16,remote-float32")
    p.add_argument("--out", default=None, help="write every answer and count as JSON here")
    p.add_argument("--previous", default=None,
                   help="a JSON of an earlier run with the same prompts and --max-tokens: "
                        "its configurations join this run's report")
    args = p.parse_args()
    prompts = long_prompts(args.num_prompts)
    runs = {}
    if args.previous:
        previous = json.loads(Path(args.previous).read_text())
        if (previous["args"]["num_prompts"], previous["args"]["max_tokens"]) != \
                (args.num_prompts, args.max_tokens):
            raise SystemExit("--previous: another --num-prompts or --max-tokens")
        runs.update(previous["runs"])
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    for name in args.configs.split(","):
        t = time.perf_counter()
        load_before = os.getloadavg()[0]
        runs[name] = run_config(name, prompts, args.max_tokens)
        runs[name]["loadavg_1m_before"] = load_before
        print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
        summary = report(runs)
        if args.out:  # after every configuration, so a cut-short run keeps what it measured
            Path(args.out).write_text(json.dumps({
                "args": vars(args), "cpu": cpu, "summary": summary, "runs": runs}, indent=1))
    print_table(summary)


if __name__ == "__main__":
    main()
