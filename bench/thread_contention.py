"""Decode speed of one greedy request at 1 and 2 torch intra-op threads, on a quiet host and
with busy processes competing for the cores (issue 24: on the shared 2-core dev host a
decode worker with two threads ran so slowly that the 10-kill test's streams read as
stalled).

Each condition runs the default model (fp32) for ``--tokens`` greedy tokens, ``--rounds``
times; the table gives the median ms/token and its ratio to 1 thread under the same
condition. The busy processes are plain Python spin loops, one per ``--busy``.

    .venv/bin/python bench/thread_contention.py --busy 2 --out bench/results/<dir>
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import time
from pathlib import Path


def _spin(stop) -> None:
    """A busy process: burns CPU until ``stop`` is set."""
    while not stop.is_set():
        sum(range(10_000))


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _ms_per_token(llm, params, prompt: str, num_tokens: int) -> float:
    start_s = time.perf_counter()
    llm.generate([prompt], params)
    return (time.perf_counter() - start_s) / num_tokens * 1000


def main() -> None:
    """Measure and print the table; write ``thread_contention.json`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=2, help="competing busy processes")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch  # noqa: PLC0415

    from pdserve.engine.entrypoints.llm import LLM  # noqa: PLC0415
    from pdserve.engine.sampling_params import SamplingParams  # noqa: PLC0415

    llm = LLM(dtype="float32", num_kv_blocks=64, max_model_len=512, load_progress=False)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompt = "Story 1: a lighthouse keeper named Tom counts 1 ships."
    _ms_per_token(llm, params, prompt, args.tokens)  # warm-up
    results = []
    for busy in (0, args.busy):
        stop = multiprocessing.Event()
        spinners = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(busy)]
        for p in spinners:
            p.start()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                samples = [_ms_per_token(llm, params, prompt, args.tokens)
                           for _ in range(args.rounds)]
                results.append({"busy_processes": busy, "threads": threads,
                                "ms_per_token": samples,
                                "median_ms_per_token": statistics.median(samples),
                                "loadavg_1m": os.getloadavg()[0]})
        finally:
            stop.set()
            for p in spinners:
                p.join()
    print(f"{'busy':>4} {'threads':>7} {'ms/token':>9} {'vs 1 thread':>11}")
    for row in results:
        base = next(r for r in results if r["busy_processes"] == row["busy_processes"]
                    and r["threads"] == 1)["median_ms_per_token"]
        row["ratio_vs_1_thread"] = row["median_ms_per_token"] / base
        print(f"{row['busy_processes']:>4} {row['threads']:>7} "
              f"{row['median_ms_per_token']:>9.0f} {row['ratio_vs_1_thread']:>10.2f}x")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "thread_contention.json").write_text(json.dumps({
            "cpu_model": _cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "args": {k: str(v) for k, v in vars(args).items()}, "results": results},
            indent=1))


if __name__ == "__main__":
    main()
