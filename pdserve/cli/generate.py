"""``pdserve generate``: offline generation for a few prompts, with the answers on stdout
and the throughput on stderr."""

from __future__ import annotations

import argparse
import sys
import time


def _cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.entrypoints.arg_utils import engine_config_from_args

    llm = LLM.from_config(engine_config_from_args(args, args.model))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.request_seed, ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["What is the capital of France?"]
    inputs = [llm.chat_prompt_ids([{"role": "user", "content": p}]) if not args.raw else p
              for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params)
    elapsed = time.perf_counter() - t0
    num_tokens = 0
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        num_tokens += len(comp.token_ids)
        print(f"### {prompt}\n{comp.text}\n[{len(comp.token_ids)} tokens, {comp.finish_reason}]")
    print(f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tok/s)",
          file=sys.stderr)
    return 0


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``generate`` to the subcommands ``sub``: sampling flags plus the engine's."""
    from pdserve.engine.entrypoints.arg_utils import add_engine_args

    p = sub.add_parser("generate", help="generate offline for a few prompts")
    p.add_argument("model", nargs="?", default=None,
                   help="model folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", action="append", help="a user message (repeatable)")
    p.add_argument("--raw", action="store_true", help="send prompts without the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--request-seed", type=int, default=None,
                   help="per-request sampling seed (default: none, not reproducible)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    add_engine_args(p)
    p.set_defaults(func=_cmd_generate)
