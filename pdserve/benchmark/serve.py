"""``pdserve bench``: load against any OpenAI-compatible endpoint (pdserve, vLLM, llama.cpp's
server), reported with the field names of ``vllm bench serve``.

    requests ──arrivals (Poisson at --request-rate, gamma with --burstiness; or all at once)──▶
    semaphore (--max-concurrency) ──▶ streamed HTTP request ──▶ RequestOutput ──▶ metrics
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from pdserve.benchmark.datasets import (
    SampleRequest,
    mixed_requests,
    random_requests,
    sharegpt_requests,
)
from pdserve.benchmark.metrics import (
    LATENCY_METRICS,
    calculate_metrics,
    detailed_fields,
    parse_goodput,
)
from pdserve.benchmark.request_func import (
    BACKEND_ENDPOINTS,
    RequestOutput,
    RequestSettings,
    send_request,
)


def _extra_body(text: str | None) -> dict | None:
    """``--extra-body``: a JSON object, or ``@FILE`` holding one.

    Raises:
        ValueError: not a JSON object.
    """
    if not text:
        return None
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    body = json.loads(text)
    if not isinstance(body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return body


def arrival_offsets_s(num_requests: int, request_rate: float, burstiness: float,
                      seed: int) -> list[float]:
    """Send times relative to the start: gamma-distributed gaps with mean ``1/rate``
    (``burstiness`` 1 is a Poisson process); all zero for an infinite rate.

    Raises:
        ValueError: ``request_rate`` or ``burstiness`` <= 0.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if np.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                     size=num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


async def run_requests(settings: RequestSettings, requests: Sequence[SampleRequest],
                       offsets_s: Sequence[float], max_concurrency: int | None,
                       show_progress: bool) -> tuple[list[RequestOutput], float]:
    """Send every request at its offset (at most ``max_concurrency`` in flight); returns
    the outputs in request order and the run's duration in seconds."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not show_progress, desc="requests")
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)

    async with httpx.AsyncClient(limits=limits, timeout=settings.timeout_s) as client:
        start = time.perf_counter()

        async def one(request: SampleRequest, offset_s: float) -> RequestOutput:
            await asyncio.sleep(max(0.0, start + offset_s - time.perf_counter()))
            if limit is None:
                out = await send_request(client, settings, request)
            else:
                async with limit:
                    out = await send_request(client, settings, request)
            bar.update(1)
            return out

        outputs = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets_s)))
        duration = time.perf_counter() - start
    bar.close()
    return list(outputs), duration


def count_missing_output_tokens(outputs: Sequence[RequestOutput], tokenizer) -> None:
    """Fill ``output_len`` of successful outputs without server usage by re-tokenizing."""
    for out in outputs:
        if out.success and out.output_len is None:
            out.output_len = len(tokenizer.encode(out.generated_text, add_special_tokens=False))


def _load_requests(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    if args.dataset_name == "random":
        return random_requests(tokenizer, args.num_prompts, args.random_input_len,
                               args.random_output_len, args.random_range_ratio, args.seed)
    if args.dataset_name == "mixed":
        return mixed_requests(tokenizer, args.num_prompts, args.seed)
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path")
    return sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts,
                             args.sharegpt_output_len, args.seed)


def _served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()
        return models["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"cannot list models at {base_url}/v1/models ({exc}); pass "
                         f"--model") from None


def _load_tokenizer(name: str | None):
    if name is None:
        from pdserve.engine.loader import load_tokenizer, resolve_model

        return load_tokenizer(resolve_model(None))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def print_summary(result: dict) -> None:
    """The human-readable table (same rows as ``vllm bench serve``)."""
    rows = [("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Benchmark duration (s)", result["duration"]),
            ("Total input tokens", result["total_input_tokens"]),
            ("Total generated tokens", result["total_output_tokens"]),
            ("Request throughput (req/s)", result["request_throughput"]),
            ("Output token throughput (tok/s)", result["output_throughput"]),
            ("Total token throughput (tok/s)", result["total_token_throughput"])]
    if result["request_goodput"] is not None:
        rows.append(("Request goodput (req/s)", result["request_goodput"]))
    print(f"{' Serving Benchmark Result ':=^50}")
    for label, value in rows:
        print(f"{label + ':':<40} {value:<10.2f}" if isinstance(value, float)
              else f"{label + ':':<40} {value:<10}")
    for name in LATENCY_METRICS:
        keys = [k for k in result if k.endswith(f"_{name}_ms") and not k.startswith("std_")]
        if keys:
            print(f"{' ' + name.upper() + ' ':-^50}")
            for k in keys:
                print(f"{k.split('_')[0].capitalize() + ' ' + name.upper() + ' (ms):':<40} "
                      f"{result[k]:<10.2f}")
    print("=" * 50)


def run_bench(args: argparse.Namespace) -> dict:
    """Run the benchmark ``args`` describe; prints the summary, writes the JSON result when
    asked, and returns the result dict.

    Raises:
        ValueError: bad arguments, no model to name, or an unusable dataset.
    """
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    slos = parse_goodput(args.goodput)
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    selected = args.percentile_metrics.split(",")
    model = args.model or _served_model(base_url, api_key)
    tokenizer = _load_tokenizer(args.tokenizer)
    requests = _load_requests(args, tokenizer)
    settings = RequestSettings(
        backend=args.backend, url=base_url + (args.endpoint or BACKEND_ENDPOINTS[args.backend]),
        model=model, temperature=args.temperature, ignore_eos=args.ignore_eos,
        api_key=api_key, timeout_s=args.request_timeout, extra_body=_extra_body(args.extra_body))
    offsets = arrival_offsets_s(len(requests), args.request_rate, args.burstiness, args.seed)
    outputs, duration = asyncio.run(run_requests(settings, requests, offsets,
                                                 args.max_concurrency, not args.disable_tqdm))
    count_missing_output_tokens(outputs, tokenizer)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": args.backend,
        "backend": args.backend, "label": args.label, "model_id": model,
        "tokenizer_id": args.tokenizer or "default", "num_prompts": len(requests),
        "request_rate": args.request_rate if np.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        **calculate_metrics(outputs, duration, slos, percentiles, selected),
    }
    if args.save_detailed:
        result.update(detailed_fields(outputs))
    print_summary(result)
    if args.save_result or args.result_filename:
        name = args.result_filename or (f"{args.backend}-{args.request_rate}qps-"
                                         f"{model.split('/')[-1]}-{result['date']}.json")
        path = Path(args.result_dir or ".") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"result written to {path}")
    return result
