"""``pdserve bench``: load an OpenAI-compatible endpoint and report its latencies; the flags
and the run live in :mod:`pdserve.benchmark`."""

from __future__ import annotations

import argparse


def _cmd_bench(args: argparse.Namespace) -> int:
    from pdserve.benchmark.serve import run_bench

    result = run_bench(args)
    return 0 if result["completed"] else 1


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``bench`` to the subcommands ``sub``; exits 1 when no request completed."""
    from pdserve.benchmark.cli_args import add_bench_args

    p = sub.add_parser("bench", help="load an OpenAI-compatible endpoint; report TTFT, TPOT, "
                                      "ITL, E2E latency and throughput like vllm bench serve")
    add_bench_args(p)
    p.set_defaults(func=_cmd_bench)
