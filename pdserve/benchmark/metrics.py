"""Benchmark statistics under the names ``vllm bench serve`` writes.

Definitions (per successful request; times reported in milliseconds):

- TTFT: request sent -> first content chunk.
- TPOT: ``(E2EL - TTFT) / (output_len - 1)``, for requests with more than one output token.
- ITL: every gap between consecutive content chunks, pooled over requests.
- E2EL: request sent -> end of stream.
- goodput: successful requests per second that met every SLO given (``ttft``, ``tpot``,
  ``e2el``, in ms).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.benchmark.request_func import RequestOutput

#: Metrics that have mean/median/std/percentile fields.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
#: SLO keys ``--goodput`` accepts.
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds).

    Raises:
        ValueError: an item is not ``KEY:VALUE`` with a known key and a value >= 0.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: expected KEY:MS with KEY in {GOODPUT_METRICS}, "
                             f"got {item!r}")
        slos[key] = float(value)
        if slos[key] < 0:
            raise ValueError(f"--goodput: {key} must be >= 0 ms, got {value}")
    return slos


def tpot_s(out: RequestOutput) -> float | None:
    """Time per output token after the first, in seconds; None for one-token outputs."""
    if out.output_len is None or out.output_len < 2:
        return None
    return (out.latency_s - out.ttft_s) / (out.output_len - 1)


def _meets_slos(out: RequestOutput, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": out.ttft_s * 1e3, "e2el": out.latency_s * 1e3,
                 "tpot": (tpot_s(out) or 0.0) * 1e3}
    return all(values_ms[key] <= limit for key, limit in slos.items())


def _stats(name: str, values_ms: list[float], percentiles: Sequence[float]) -> dict:
    arr = np.asarray(values_ms or [0.0], dtype=np.float64)
    stats = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
             f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        stats[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return stats


def calculate_metrics(outputs: Sequence[RequestOutput], duration_s: float,
                      slos: dict[str, float] | None = None,
                      percentiles: Sequence[float] = (99.0,),
                      selected: Sequence[str] = LATENCY_METRICS) -> dict:
    """The result fields of a run (no per-request lists; see :func:`detailed_fields`).

    Args:
        outputs: every request's output (failed ones included).
        duration_s: wall time of the whole run.
        slos: goodput SLOs in ms (``request_goodput`` is None without them).
        percentiles: which percentiles to report (``p99_ttft_ms`` for 99).
        selected: which of :data:`LATENCY_METRICS` get statistics.

    Raises:
        ValueError: ``duration_s`` <= 0 or an unknown metric in ``selected``.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    unknown = set(selected) - set(LATENCY_METRICS)
    if unknown:
        raise ValueError(f"unknown percentile metrics {sorted(unknown)}")
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_len or 0 for o in done)
    values_ms = {
        "ttft": [o.ttft_s * 1e3 for o in done],
        "tpot": [t * 1e3 for t in (tpot_s(o) for o in done) if t is not None],
        "itl": [gap * 1e3 for o in done for gap in o.itl_s],
        "e2el": [o.latency_s * 1e3 for o in done],
    }
    result = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": (sum(_meets_slos(o, slos) for o in done) / duration_s
                            if slos else None),
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for name in selected:
        result.update(_stats(name, values_ms[name], percentiles))
    return result


def detailed_fields(outputs: Sequence[RequestOutput]) -> dict:
    """Per-request lists (``--save-detailed``), in request order; times in seconds."""
    return {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_len or 0 for o in outputs],
        "ttfts": [o.ttft_s for o in outputs],
        "itls": [o.itl_s for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
