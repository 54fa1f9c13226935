"""Arguments of ``pdserve bench``, named like ``vllm bench serve``'s."""

from __future__ import annotations

import argparse

from pdserve.benchmark.request_func import BACKEND_ENDPOINTS


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Add the ``pdserve bench`` options to ``p``."""
    g = p.add_argument_group("endpoint")
    g.add_argument("--backend", default="openai-chat", choices=sorted(BACKEND_ENDPOINTS),
                   help="openai-chat: /v1/chat/completions; openai: /v1/completions")
    g.add_argument("--base-url", default=None,
                   help="server root, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=None, help="path (default: by --backend)")
    g.add_argument("--model", default=None, help="model name (default: the first of "
                   "/v1/models)")
    g.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer folder or name "
                   "for building prompts (default: the embedded default model's)")
    g.add_argument("--api-key", default=None, help="bearer token (or OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=["random", "mixed", "sharegpt"],
                   help="mixed: 95 %% short (64-256 prompt, 64-128 output tokens), 5 %% long "
                        "(1,500-3,000 prompt, 64 output tokens)")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in len * [1 - r, 1 + r]")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed max_tokens for ShareGPT requests (default: the answer's length)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson); inf sends all at once")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps; 1 is Poisson, lower is burstier")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no limit)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", default=None, metavar="JSON|@FILE",
                   help="fields added to every request body, e.g. a response_format")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos so every output runs to max_tokens")
    g = p.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el)")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    g.add_argument("--save-result", action="store_true", help="write the JSON result")
    g.add_argument("--save-detailed", action="store_true",
                   help="add per-request lists (input_lens, output_lens, ttfts, itls, ...)")
    g.add_argument("--result-dir", default=None,
                   help="folder of the JSON result (default: the current folder)")
    g.add_argument("--result-filename", default=None,
                   help="file name of the JSON result; implies --save-result (default: "
                        "BACKEND-RATEqps-MODEL-TIME.json)")
    g.add_argument("--label", default=None, help="free text stored in the result")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
