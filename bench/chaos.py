"""Chaos: kill -9 the workers of a live ``pdserve serve``; no client should notice.

One server (default model, fp32 so greedy text is deterministic, 1 prefill + 1 decode
worker on a core each: two threads per worker on a busy 2-core machine run ~10x slower):

- decode: ``--num-streams`` greedy ``ignore_eos`` streams run undisturbed (references),
  then again while the decode worker is killed ``--num-kills`` times, each once every
  running stream got ``--min-new-tokens`` since the last restart. Per stream: tokens
  received (``logprobs.tokens``, and ``usage``), text identical, no error event; per kill:
  time-to-back (kill -> a new decode worker id in ``pdserve:worker_up``).
- prefill: ``--num-kills`` rounds of ``--prefill-batch`` prompts of 1,500-2,000 random
  tokens (remote at the default threshold 512), the prefill worker killed 0.2-1.0 x an
  undisturbed long prompt's TTFT after sending. Each must end whole within the bound.

    python bench/chaos.py [--num-kills 10] [--num-streams 8] [--max-tokens 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_utils import (child_pids, free_port, metrics, pid_alive,  # noqa: E402
                          stop_process, wait_health)

MODEL = "SmolLM2-135M-Instruct"
STORY_PROMPTS = tuple(f"Write a long story about {topic}." for topic in (  # decode phase
    "a lighthouse keeper named Tom", "a steam engine", "a journey across the Sahara",
    "the printing press", "a sailor far from home", "the life of a star",
    "a baker in Vienna", "a dragon who was afraid of fire"))


@dataclass
class StreamResult:
    """What one client saw of one streamed completion."""

    index: int
    num_tokens: int = 0  # tokens in the stream's logprobs, counted here
    usage_completion_tokens: int | None = None
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    elapsed_s: float = 0.0
    first_token_s: float | None = None  # from sending
    token_times_s: list[float] = field(default_factory=list, repr=False)  # monotonic


@dataclass
class KillRecord:
    """One kill -9 and what followed (``at_s``: monotonic)."""

    kill: int
    pid: int
    old_worker_id: str
    new_worker_id: str | None = None
    back_s: float | None = None  # kill -> new worker id in pdserve:worker_up
    at_s: float = 0.0
    num_streams_running: int = 0
    resume_s: float | None = None  # decode phase: kill -> every stream's first new token
    kill_after_send_s: float | None = None  # prefill phase: delay after sending the round


class ChaosServer:
    """``pdserve serve`` on a free loopback port, with its output in ``log_path``; the
    ``pdserve`` package is imported from ``root`` (e.g. a ``git archive`` of one commit)."""

    def __init__(self, serve_args: list[str], log_path: Path, root: Path) -> None:
        self.base = f"http://127.0.0.1:{free_port()}"
        self.url = f"{self.base}/v1/completions"
        self.log = open(log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(root))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "serve", "--port", self.base.rsplit(":")[-1],
             *serve_args], env=env, cwd=root, stdout=self.log, stderr=subprocess.STDOUT)
        if not wait_health(self.base, 200, self.proc, timeout_s=300.0):
            self.stop()
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"pdserve serve did not become healthy (exit code "
                               f"{self.proc.returncode}); the end of {log_path}:\n"
                               + "\n".join(tail))

    def worker_pid(self, role: str) -> int:
        """Pid of the one live ``<role>-worker`` child of the serve process."""
        pids = [p for p in child_pids(self.proc.pid) if pid_alive(p)
                and f"{role}-worker".encode() in Path(f"/proc/{p}/cmdline").read_bytes()]
        if len(pids) != 1:
            raise RuntimeError(f"expected one live {role}-worker child, found {pids}")
        return pids[0]

    async def metrics(self) -> dict[str, float]:
        """Flat ``{name{labels}: value}`` of the server's /metrics (model label dropped)."""
        return await asyncio.to_thread(metrics, self)

    async def worker_ids(self, role: str) -> set[str]:
        """Ids of the registered, alive workers of ``role``."""
        prefix = f"pdserve:worker_up{{role={role},worker_id="
        return {k[len(prefix):-1] for k, v in (await self.metrics()).items()
                if k.startswith(prefix) and v == 1}

    async def wait_new_worker(self, role: str, old: set[str], timeout_s: float) -> str | None:
        """The id of a ``role`` worker not in ``old`` once one is up; None on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if new := await self.worker_ids(role) - old:
                return sorted(new)[0]
            await asyncio.sleep(0.1)
        return None

    def stop(self) -> None:
        """SIGTERM the server (its workers die with it)."""
        stop_process(self.proc)
        self.log.close()


async def stream_completion(client: httpx.AsyncClient, url: str, prompt, max_tokens: int,
                            res: StreamResult, bound_s: float = 600.0) -> StreamResult:
    """One greedy streamed completion, filled into ``res`` as it arrives (others may watch
    it; every token's arrival time goes in ``res.token_times_s``); not ended within
    ``bound_s``: a hang, an error."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0,
            "stream_options": {"include_usage": True}}
    start = time.monotonic()
    try:
        async with asyncio.timeout(bound_s), client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    res.error = json.dumps(chunk["error"])[:300]
                if chunk.get("usage"):
                    res.usage_completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    res.text += choice.get("text", "")
                    num_new = len((choice.get("logprobs") or {}).get("tokens") or [])
                    res.num_tokens += num_new
                    res.token_times_s += [time.monotonic()] * num_new
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                    if num_new and res.first_token_s is None:
                        res.first_token_s = time.monotonic() - start
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    except TimeoutError:
        res.error = f"hang: no end within {bound_s:g} s"
    res.elapsed_s = time.monotonic() - start
    return res


async def kill_and_wait(server: ChaosServer, role: str, kill: int,
                        back_timeout_s: float) -> KillRecord:
    """SIGKILL the ``role`` worker and wait for its successor to register."""
    (old_id,) = await server.worker_ids(role)
    pid = server.worker_pid(role)
    rec = KillRecord(kill, pid, old_id, at_s=time.monotonic())
    os.kill(pid, signal.SIGKILL)
    rec.new_worker_id = await server.wait_new_worker(role, {old_id}, back_timeout_s)
    if rec.new_worker_id is not None:
        rec.back_s = round(time.monotonic() - rec.at_s, 2)
    return rec


async def decode_kills(server: ChaosServer, live: list[StreamResult], tasks: list[asyncio.Task],
                       args, rng: random.Random) -> list[KillRecord]:
    """Kill the decode worker ``args.num_kills`` times, each once every running stream has
    received ``args.min_new_tokens`` tokens since the previous restart (or waited
    ``args.resume_timeout_s``)."""
    records, since = [], time.monotonic()
    for kill in range(1, args.num_kills + 1):
        deadline = time.monotonic() + args.resume_timeout_s
        while time.monotonic() < deadline and not all(
                t.done() or sum(x > since for x in r.token_times_s) >= args.min_new_tokens
                for r, t in zip(live, tasks)):
            await asyncio.sleep(0.05)
        await asyncio.sleep(rng.uniform(0.2, 1.5))
        running = sum(not t.done() for t in tasks)
        if running == 0:
            print(f"  all streams ended before kill {kill}", flush=True)
            break
        since = (rec := await kill_and_wait(server, "decode", kill, args.back_timeout_s)).at_s
        rec.num_streams_running = running
        records.append(rec)
        print(f"  decode kill {kill}: pid {rec.pid}, {running} streams running, back in "
              f"{rec.back_s} s as {rec.new_worker_id}", flush=True)
    return records


async def decode_phase(server: ChaosServer, client: httpx.AsyncClient, args,
                       rng: random.Random) -> dict:
    """Reference streams undisturbed, then the same streams under decode-worker kills."""
    prompts = [STORY_PROMPTS[i % len(STORY_PROMPTS)] for i in range(args.num_streams)]
    print(f"decode phase: {args.num_streams} undisturbed streams ...", flush=True)
    ref = await asyncio.gather(*[stream_completion(client, server.url, p, args.max_tokens,
                                                   StreamResult(i), args.stream_bound_s)
                                 for i, p in enumerate(prompts)])
    print(f"  reference done in {max(r.elapsed_s for r in ref):.1f} s", flush=True)
    live = [StreamResult(i) for i in range(args.num_streams)]
    tasks = [asyncio.create_task(stream_completion(client, server.url, p, args.max_tokens, r,
                                                   args.stream_bound_s))
             for p, r in zip(prompts, live)]
    kills = await decode_kills(server, live, tasks, args, rng)
    await asyncio.gather(*tasks)
    for k in kills:
        back = k.at_s + (k.back_s or 0.0)  # tokens before it were the dead worker's last
        waits = [next(x for x in r.token_times_s if x > back) - k.at_s for r in live
                 if r.token_times_s and r.token_times_s[-1] > back]
        k.resume_s = round(max(waits), 2) if waits else None
    streams = [{"stream": r.index, "num_tokens": r.num_tokens,
                "usage_completion_tokens": r.usage_completion_tokens,
                "has_all_tokens": r.num_tokens == args.max_tokens,
                "is_text_identical": r.text == ref[r.index].text and ref[r.index].error is None,
                "first_diff_char": None if r.text == ref[r.index].text else
                len(os.path.commonprefix([r.text, ref[r.index].text])),
                "finish_reason": r.finish_reason, "error": r.error,
                "elapsed_s": round(r.elapsed_s, 1)} for r in live]
    return {"reference_errors": [r.error for r in ref], "streams": streams,
            "reference_s": round(max(r.elapsed_s for r in ref), 1),
            "kills": [asdict(k) for k in kills]}


def long_prompt(rng: random.Random) -> list[int]:
    """1,500-2,000 random token ids: remote at the default --prefill-threshold 512, and no
    prefix shared with another prompt."""
    return [rng.randrange(1000, 49000) for _ in range(rng.randint(1500, 2000))]


def counters(m: dict[str, float]) -> dict[str, float]:
    """The fault-handling counters of one /metrics reading."""
    keep = ("pdserve:kv_transfer_failures_total", "pdserve:route_decisions_total",
            "pdserve:request_retries_total", "pdserve:request_migrations_total",
            "pdserve:worker_restarts_total", "pdserve:request_timeouts_total")
    return {k: v for k, v in m.items() if k.startswith(keep)}


async def prefill_round(server: ChaosServer, client: httpx.AsyncClient, kill: int,
                        delay_s: float, args, rng: random.Random) -> tuple[dict, list[dict]]:
    """Send ``args.prefill_batch`` long prompts, kill the prefill worker ``delay_s`` later,
    wait for it to come back and for every request to end."""
    before = counters(await server.metrics())
    prompts = [long_prompt(rng) for _ in range(args.prefill_batch)]
    results = [StreamResult(i) for i in range(len(prompts))]
    t_send = time.monotonic()
    tasks = [asyncio.create_task(stream_completion(
        client, server.url, p, args.prefill_max_tokens, r, args.request_bound_s))
        for p, r in zip(prompts, results)]
    await asyncio.sleep(delay_s)
    m = await server.metrics()
    busy = sum(v for k, v in m.items()
               if k.startswith("pdserve:worker_num_requests_running{role=prefill"))
    rec = await kill_and_wait(server, "prefill", kill, args.back_timeout_s)
    rec.kill_after_send_s = round(rec.at_s - t_send, 2)
    await asyncio.gather(*tasks)
    after = counters(await server.metrics())
    rnd = {**asdict(rec), "prefill_running_at_kill": busy,
           "counter_deltas": {k: v - before.get(k, 0.0) for k, v in after.items()
                              if v != before.get(k, 0.0)}}
    reqs = [{"round": kill, "request": r.index, "prompt_tokens": len(p),
             "num_tokens": r.num_tokens, "is_complete": r.num_tokens == args.prefill_max_tokens
             and r.error is None and r.finish_reason == "length",
             "had_first_token_before_kill": r.first_token_s is not None
             and r.first_token_s < rec.kill_after_send_s,
             "first_token_s": None if r.first_token_s is None else round(r.first_token_s, 2),
             "elapsed_s": round(r.elapsed_s, 2), "finish_reason": r.finish_reason,
             "error": r.error} for p, r in zip(prompts, results)]
    return rnd, reqs


async def prefill_phase(server: ChaosServer, client: httpx.AsyncClient, args,
                        rng: random.Random) -> dict:
    """An undisturbed long prompt for its TTFT, then ``args.num_kills`` killed rounds."""
    print("prefill phase: undisturbed long prompt ...", flush=True)
    ref = await stream_completion(client, server.url, long_prompt(rng),
                                  args.prefill_max_tokens, StreamResult(0), args.request_bound_s)
    if ref.error or ref.first_token_s is None:
        raise RuntimeError(f"undisturbed long prompt failed: {ref.error}")
    print(f"  TTFT {ref.first_token_s:.2f} s", flush=True)
    rounds, requests = [], []
    for kill in range(1, args.num_kills + 1):
        delay_s = rng.uniform(0.2, 1.0) * ref.first_token_s
        rnd, reqs = await prefill_round(server, client, kill, delay_s, args, rng)
        rounds.append(rnd)
        requests += reqs
        print(f"  prefill kill {kill} at +{rnd['kill_after_send_s']} s: back in "
              f"{rnd['back_s']} s; {sum(r['is_complete'] for r in reqs)}/{len(reqs)} complete, "
              f"slowest {max(r['elapsed_s'] for r in reqs)} s", flush=True)
    return {"undisturbed_ttft_s": round(ref.first_token_s, 2), "kills": rounds,
            "requests": requests}


def restart_delays_s(log_path: Path) -> dict[str, list[float]]:
    """The supervisor's announced restart delays by role, from serve's log."""
    out: dict[str, list[float]] = {"decode": [], "prefill": []}
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("pdserve: ") and (m := line.partition("; restarting it in ")[2]):
            out.setdefault(line.split()[1], []).append(float(m.split()[0]))
    return out


def summary(result: dict) -> str:
    """The results as plain-text tables."""
    d, p, lines = result.get("decode"), result.get("prefill"), []
    for s in d["streams"] if d else []:
        lines.append(f"  {s['stream']:>6} {s['num_tokens']:>7} {s['usage_completion_tokens']!s:>6}"
                     f" {'yes' if s['is_text_identical'] else 'NO':>10}  {s['error'] or '-'}")
    lines[:0] = ["decode streams: stream  tokens  usage  identical  error"] if d else []
    for name, phase in (("decode", d), ("prefill", p)):
        kills, delays = (phase or {}).get("kills", []), result["restart_delays_s"][name]
        lines += [f"{name} kills: kill  back_s  restart_delay_s  resume_s"] if phase else []
        lines += [f"  {k['kill']:>4} {k['back_s']!s:>7} {(delays + ['?'] * 99)[i]!s:>16} "
                  f"{k['resume_s']!s:>9}" for i, k in enumerate(kills)]
    if p:
        reqs = p["requests"]
        lines.append(f"prefill requests: {sum(r['is_complete'] for r in reqs)}/{len(reqs)} "
                     f"complete, {sum(r['had_first_token_before_kill'] for r in reqs)} had "
                     f"their first token before the kill, slowest "
                     f"{max(r['elapsed_s'] for r in reqs)} s")
    return "\n".join(lines)


def machine(root: Path) -> dict:
    """CPU model, cores, date, torch, the served commit and load: the figures' context."""
    import torch
    cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
               if ln.startswith("model name"))
    commit = (root / "COMMIT").read_text().strip() if (root / "COMMIT").exists() else \
        subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                       cwd=root).stdout.strip()
    return {"cpu_model": cpu, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__, "commit": commit, "loadavg": os.getloadavg()}


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, kind, default in (
            ("--num-kills", int, 10), ("--num-streams", int, 8), ("--max-tokens", int, 512),
            ("--min-new-tokens", int, 8), ("--resume-timeout-s", float, 180.0),
            ("--back-timeout-s", float, 120.0), ("--prefill-batch", int, 3),
            ("--prefill-max-tokens", int, 16), ("--request-bound-s", float, 180.0),
            ("--stream-bound-s", float, 1800.0), ("--max-worker-restart-backoff", float, 4.0),
            ("--seed", int, 0)):
        ap.add_argument(flag, type=kind, default=default)
    ap.add_argument("--pdserve-root", type=Path, default=Path(__file__).resolve().parents[1],
                    help="folder whose pdserve package is served (default: this checkout)")
    ap.add_argument("--skip", choices=("decode", "prefill"), default=None)
    ap.add_argument("--out", type=Path, help="default: bench/results/chaos-<date>-<cpu>-<simd>")
    return ap.parse_args(argv)


async def run(args: argparse.Namespace) -> dict:
    """Both phases against one server; returns the JSON-able result."""
    cores = sorted(os.sched_getaffinity(0))  # e.g. "2-3" in a container, not "0-1"
    pinning = (["--decode-cpus", str(cores[-1]), "--prefill-cpus", str(cores[0])]
               if len(cores) >= 2 else [])
    serve_args = ["--dtype", "float32", "--max-model-len", "4096", "--num-kv-blocks", "1024",
                  *pinning,
                  "--max-worker-restarts", str(4 * args.num_kills + 2),
                  "--max-worker-restart-backoff", str(args.max_worker_restart_backoff)]
    rng = random.Random(args.seed)
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "serve_args": serve_args, "machine": machine(args.pdserve_root)}
    server = ChaosServer(serve_args, args.out / "serve.log", args.pdserve_root)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
            if args.skip != "decode":
                result["decode"] = await decode_phase(server, client, args, rng)
            if args.skip != "prefill":
                result["prefill"] = await prefill_phase(server, client, args, rng)
            result["final_counters"] = counters(await server.metrics())
    finally:
        server.stop()
    result["restart_delays_s"] = restart_delays_s(args.out / "serve.log")
    result["machine"]["loadavg_after"] = os.getloadavg()
    return result


def main(argv=None) -> None:
    """Run, write ``chaos.json``, print the tables."""
    args = parse_args(argv)
    if args.out is None:
        flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
        cpu = machine(args.pdserve_root)["cpu_model"].split()[-1].lower()  # AMD EPYC: epyc
        args.out = (Path(__file__).parent / "results" / f"chaos-{time.strftime('%Y-%m-%d')}-"
                    f"{cpu}-{'avx512' if 'avx512f' in flags else 'avx2'}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args))
    (args.out / "chaos.json").write_text(json.dumps(result, indent=1))
    print(summary(result))


if __name__ == "__main__":
    main()
