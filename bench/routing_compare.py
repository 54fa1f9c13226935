"""Routing policies compared: ``--routing threshold`` vs ``--routing predicted``, same run.

One topology, started fresh for every run: the API server and router, a prefill worker
pinned to core 0 and a decode worker pinned to core 1 (one torch thread each), as
the disaggregated topology of ``bench/mixed_load.py``. Three workloads:

- ``poisson-<rate>``: mixed_load's Poisson 95 % short / 5 % long mix of
  ``/v1/completions`` (random token ids, nothing cached), at each ``--rates``;
- ``chat``: concurrent multi-turn conversations over ``/v1/chat/completions``. Each opens
  with a long unique document (consecutive README paragraphs under a header naming the
  conversation, >= 600 prompt tokens) and a short question; each next turn resends the
  whole history plus the reply and a new short question after a think time, so turns 2-4
  repeat the previous prompt as their prefix and the decode worker holds it cached.

Each run first sends two unmeasured warm-up requests (one long, one short) so both workers
have measured prefill rates, then the workload; ``pdserve:route_decisions_total`` by kind
is scraped from /metrics before and after, and the difference is recorded. Policies
alternate inside each repetition (the first one swaps every repetition) so host noise
hits both. Every run is written to ``--out`` as JSON; ``--report`` prints the table of
what is there.

    python bench/routing_compare.py --out bench/results/routing-DATE-cpu [--reps 2]
    python bench/routing_compare.py --out bench/results/routing-DATE-cpu --report
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from mixed_load import Cluster, pct, route_counts, run_requests, start_cluster, summarize, workload

README = Path(__file__).resolve().parent.parent / "README.md"
#: every --routing policy, in table order; --policies picks the ones run
ALL_POLICIES = ("threshold", "predicted", "length")
QUESTIONS = [
    "Summarize the document above in a few sentences.",
    "Which part of it matters most to someone running the server?",
    "What would you test first, and why?",
    "List two open questions the document leaves.",
    "Explain the second paragraph to a new engineer.",
    "What numbers does it report, and what do they measure?",
]
@dataclass(frozen=True)
class ChatWorkload:
    """Shape of the chat run.

    Attributes:
        num_conversations: conversations, each with its own document.
        num_turns: user turns per conversation.
        document_chars: document length (README text: 2.3-3 characters a token).
        conversation_rate: conversations started per second (Poisson).
        mean_think_s: mean think time between a reply and the next turn (exponential).
        max_tokens: reply tokens per turn.
        seed: arrivals, think times and questions.
    """

    num_conversations: int = 20
    num_turns: int = 4
    document_chars: int = 2200
    conversation_rate: float = 0.4
    mean_think_s: float = 3.0
    max_tokens: int = 64
    seed: int = 0


@dataclass
class TurnRecord:
    """One measured turn."""

    conversation: int
    turn: int
    start_s: float
    ttft_s: float | None
    num_output_chunks: int
    prompt_tokens: int
    cached_tokens: int


def documents(num: int, num_chars: int) -> list[str]:
    """``num`` unique documents of about ``num_chars`` characters: windows of the README's
    prose (paragraphs of more than 80 characters), window ``i`` starting ``i / num`` of the
    way through and cut back to a word boundary, under a header naming the conversation."""
    paragraphs = [p.strip() for p in README.read_text().split("\n\n") if len(p.strip()) > 80]
    text = "\n\n".join(paragraphs)
    text += "\n\n" + text[:num_chars]  # windows near the end wrap around
    stride = (len(text) - num_chars) // num
    out = []
    for i in range(num):
        window = text[i * stride:i * stride + num_chars]
        window = window[window.find(" ") + 1:window.rfind(" ")]
        out.append(f"Conversation {i}: project handbook, excerpt {i + 1} of {num}.\n\n{window}")
    return out


async def stream_turn(http: httpx.AsyncClient, base: str, messages: list[dict],
                      max_tokens: int) -> tuple[float | None, int, str, dict]:
    """One streamed chat turn: (TTFT s, content chunks, reply text, usage)."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, num_chunks, text, usage = time.perf_counter(), None, 0, [], {}
    async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            content = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") \
                else None
            if content:
                ttft = ttft or time.perf_counter() - start
                num_chunks += 1
                text.append(content)
    return ttft, num_chunks, "".join(text), usage


async def conversation(http: httpx.AsyncClient, base: str, index: int, document: str,
                       start_s: float, wl: ChatWorkload, t0: float) -> list[TurnRecord]:
    """Run conversation ``index``: wait until ``start_s``, then its turns with think times."""
    rng = random.Random(wl.seed * 1000 + index)
    await asyncio.sleep(start_s)
    messages = [{"role": "system", "content": document}]
    records = []
    for turn in range(wl.num_turns):
        messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
        sent_s = time.perf_counter() - t0
        ttft, num_chunks, reply, usage = await stream_turn(http, base, messages, wl.max_tokens)
        details = usage.get("prompt_tokens_details") or {}
        records.append(TurnRecord(index, turn + 1, sent_s, ttft, num_chunks,
                                  usage.get("prompt_tokens", 0),
                                  details.get("cached_tokens", 0)))
        messages.append({"role": "assistant", "content": reply})
        if turn + 1 < wl.num_turns:
            await asyncio.sleep(rng.expovariate(1 / wl.mean_think_s))
    return records


async def run_chat(base: str, wl: ChatWorkload) -> tuple[list[TurnRecord], float]:
    """All conversations concurrently; returns every turn's record and the run's wall time."""
    rng = random.Random(wl.seed)
    starts, t = [], 0.0
    for _ in range(wl.num_conversations):
        starts.append(t)
        t += rng.expovariate(wl.conversation_rate)
    docs = documents(wl.num_conversations, wl.document_chars)
    async with httpx.AsyncClient(timeout=900) as http:
        t0 = time.perf_counter()
        per_conv = await asyncio.gather(*(conversation(http, base, i, docs[i], starts[i], wl, t0)
                                          for i in range(wl.num_conversations)))
        elapsed = time.perf_counter() - t0
    return [r for conv in per_conv for r in conv], elapsed


def records_as_dicts(records: list[TurnRecord]) -> list[dict]:
    """JSON-ready records."""
    return [asdict(r) for r in records]


def chat_summary(records: list[TurnRecord], elapsed: float) -> dict:
    """TTFT percentiles of first turns and of follow-up turns, throughput, cache hits."""
    first = [r for r in records if r.turn == 1]
    follow = [r for r in records if r.turn > 1]
    ok = [r.ttft_s for r in first if r.ttft_s is not None]
    ok_follow = [r.ttft_s for r in follow if r.ttft_s is not None]
    return {"num_requests": len(records), "num_failed": sum(r.ttft_s is None for r in records),
            "ttft_first_p50": pct(ok, 50), "ttft_first_p99": pct(ok, 99),
            "ttft_follow_p50": pct(ok_follow, 50), "ttft_follow_p99": pct(ok_follow, 99),
            "tok_s": sum(r.num_output_chunks for r in records) / elapsed, "elapsed_s": elapsed,
            "min_first_prompt_tokens": min(r.prompt_tokens for r in first),
            "follow_prompt_tokens": sum(r.prompt_tokens for r in follow),
            "follow_cached_tokens": sum(r.cached_tokens for r in follow)}


async def warm_up(base: str) -> None:
    """Two long requests and a short one, unmeasured, so both workers report prefill
    rates (a worker does not measure its first step; with no rates, both policies send
    the long ones to the prefill worker and the short one to the decode worker)."""
    rng = random.Random(12345)
    async with httpx.AsyncClient(timeout=300) as http:
        for num_tokens in (800, 800, 120):
            body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
                    "prompt": [rng.randrange(1000, 49000) for _ in range(num_tokens)]}
            (await http.post(f"{base}/v1/completions", json=body)).raise_for_status()
    await asyncio.sleep(2.5)  # a heartbeat or two carries the measured rates


def start_with_retries(threshold: int, policy: str, num_attempts: int = 3) -> Cluster:
    """The disaggregated cluster; a start that fails (on this shared host a worker has
    failed to load torch under memory pressure) is retried."""
    for attempt in range(num_attempts):
        try:
            return start_cluster(True, threshold, policy)
        except RuntimeError as exc:
            if attempt + 1 == num_attempts:
                raise
            print(f"  cluster start failed ({exc}); retrying", flush=True)
            time.sleep(5)
    raise AssertionError("unreachable")


def run_one(name: str, policy: str, rep: int, args: argparse.Namespace) -> dict:
    """Start a fresh cluster with ``--routing policy``, warm it up, run workload ``name``
    (``chat`` or ``poisson-<rate>``) and return its summary with the route counts."""
    cluster = start_with_retries(args.prefill_threshold, policy)
    load_before = os.getloadavg()[0]
    try:
        asyncio.run(warm_up(cluster.base))
        before = route_counts(cluster.base)
        if name == "chat":
            wl = ChatWorkload(num_conversations=args.conversations, num_turns=args.turns,
                              seed=rep)
            records, elapsed = asyncio.run(run_chat(cluster.base, wl))
            out = chat_summary(records, elapsed) | {"workload_spec": asdict(wl),
                                                    "records": records_as_dicts(records)}
        else:
            rate = float(name.split("-", 1)[1])
            reqs = workload(args.num_requests, rate, seed=rep)
            res, elapsed = asyncio.run(run_requests(cluster.base, reqs))
            out = summarize(name, reqs, res, elapsed) | {
                "rate": rate, "records": [{"arrival_s": q[0], "prompt_tokens": len(q[1]),
                                           "is_long": q[3], "ttft_s": r[0],
                                           "num_output_chunks": r[1]}
                                          for q, r in zip(reqs, res)]}
        after = route_counts(cluster.base)
    finally:
        cluster.stop()
    out["route_counts"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return out | {"name": name, "routing": policy, "rep": rep, "loadavg_1m_before": load_before,
                  "loadavg_1m_after": os.getloadavg()[0], "finished_at": time.time()}


def run_all(args: argparse.Namespace) -> None:
    """Every (repetition, workload, policy) not yet in ``args.out``, policies alternating."""
    args.out.mkdir(parents=True, exist_ok=True)
    names = [f"poisson-{r:g}" for r in args.rates] + (["chat"] if args.chat else [])
    for rep in range(args.first_rep, args.first_rep + args.reps):
        order = args.policies if rep % 2 == 0 else args.policies[::-1]
        for name in names:
            for policy in order:
                path = args.out / f"{name}-{policy}-rep{rep}.json"
                if path.exists():
                    continue
                print(f"rep {rep} {name} {policy} ...", flush=True)
                result = run_one(name, policy, rep, args)
                path.write_text(json.dumps(result, indent=1))
                print(f"  {result['route_counts']} "
                      f"{ {k: v for k, v in result.items() if k.startswith(('ttft', 'tok'))} }",
                      flush=True)


def metric_names(name: str) -> tuple[str, str]:
    """The two request groups of workload ``name``: (short, long) or (first, follow)."""
    return ("first", "follow") if name == "chat" else ("short", "long")


def report(out: Path) -> None:
    """Print one table row per run found in ``out`` (seconds, output tokens/s), then the
    mean over repetitions per workload and policy with predicted / threshold ratios."""
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("*-rep*.json"))]
    rows.sort(key=lambda r: (r["name"], r["rep"], r["routing"]))
    print("| workload | rep | routing | TTFT p50 / p99 short or first turn (s) | TTFT p50 / "
          "p99 long or follow-up (s) | out tok/s | route decisions | load 1m |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = metric_names(r["name"])
        counts = ", ".join(f"{k} {v}" for k, v in sorted(r["route_counts"].items()))
        print(f"| {r['name']} | {r['rep']} | {r['routing']} | "
              f"{r[f'ttft_{a}_p50']:.2f} / {r[f'ttft_{a}_p99']:.2f} | "
              f"{r[f'ttft_{b}_p50']:.2f} / {r[f'ttft_{b}_p99']:.2f} | {r['tok_s']:.1f} | "
              f"{counts} | {r['loadavg_1m_before']:.1f} |")
    policies = [pol for pol in ALL_POLICIES if any(r["routing"] == pol for r in rows)]
    others = [pol for pol in policies if pol != "threshold"]
    print("\nmean over repetitions (ratios: each policy / threshold):\n")
    print("| workload | figure | " + " | ".join(policies) + " | "
          + " | ".join(f"{pol} / threshold" for pol in others) + " |")
    print("|---|---|" + "---|" * (len(policies) + len(others)))
    for name in sorted({r["name"] for r in rows}):
        a, b = metric_names(name)
        for key in (f"ttft_{a}_p99", f"ttft_{b}_p99", f"ttft_{a}_p50", f"ttft_{b}_p50",
                    "tok_s"):
            values = {pol: [r[key] for r in rows if r["name"] == name and r["routing"] == pol]
                      for pol in policies}
            mean = {pol: sum(v) / len(v) if v else float("nan") for pol, v in values.items()}
            base = mean.get("threshold", float("nan"))
            print(f"| {name} | {key} | " + " | ".join(f"{mean[pol]:.2f}" for pol in policies)
                  + " | " + " | ".join(f"{mean[pol] / base:.2f}" for pol in others) + " |")


def main() -> None:
    """Run the comparison (or, with ``--report``, print the table of a finished one)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for one JSON per run")
    p.add_argument("--rates", type=float, nargs="*", default=[0.5, 1.0],
                   help="Poisson request rates (req/s), one workload each")
    p.add_argument("--num-requests", type=int, default=70, help="requests per Poisson run")
    p.add_argument("--no-chat", dest="chat", action="store_false",
                   help="leave out the multi-turn chat workload")
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--policies", nargs="+", choices=ALL_POLICIES,
                   default=["threshold", "predicted"], help="--routing policies to compare")
    p.add_argument("--first-rep", type=int, default=0, help="also each rep's seed")
    p.add_argument("--prefill-threshold", type=int, default=512)
    p.add_argument("--report", action="store_true", help="only print the table of --out")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the cluster on the way out
    if not args.report:
        run_all(args)
    report(args.out)


if __name__ == "__main__":
    main()
