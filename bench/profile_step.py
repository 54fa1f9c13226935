"""Where one engine step's time goes: prefill (128, 1,500, 3,000 tokens; 32 x 128) and decode
(batch 1 and 32), split by part, with the torch profiler.

Each scenario runs in the offline engine (the model the workers serve, same defaults) and
is timed over ``--repeat`` runs after a warm-up; then one more run is profiled with labelled
ranges around each part of the step, installed here on the loaded model (nothing in the
engine is changed for it):

- ``schedule``: the scheduler's ``schedule()``;
- ``input prep``: the model runner's own work outside the forward, logits and sampling
  (token/position/slot lists, tensors) plus the attention metadata (``build_metadata``);
- ``embedding``, ``gemm`` (every linear layer, LM head excluded), ``attention`` (KV store
  and SDPA), ``norm/rotary/act`` (RMSNorm, rotary, SiLU-and-mul), ``forward other`` (what
  the forward spends outside those: residual adds, views, layer loop); where the fused CPU
  kernel runs the step, the same parts come from its own timers (it is one C++ call);
- ``logits`` (LM head), ``sampling`` (sampler or rejection sampler);
- ``engine update``: the engine's bookkeeping after the runner (tokens, stop checks, blocks);
- ``messaging``: encoding the step's :class:`StepOutputs` as the decode worker sends it and
  decoding it as the router does; ``detokenize``: the server's incremental detokenizer for
  the step's new tokens (measured apart, outside the profiled step).

Prints per scenario: wall time per step, tokens/s, each part's ms and share, and the top
operators by self CPU time. ``--json FILE`` writes the figures. Prefill throughput of the
long prompts against the 32 x 128 batch is the ratio the speed issue asks for (>= 0.8):
printed from the scenarios' own figures, then (``--ratio-rounds``) as the median over rounds
that run the batch and the long prompts one after another, which the host's drift between
scenarios does not skew.

    python bench/profile_step.py [--dtype bfloat16] [--threads 2] [--scenarios ...]
                                 [--ratio-rounds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

SCENARIOS = ("prefill-128", "prefill-1500", "prefill-3000", "prefill-32x128",
             "decode-1", "decode-32")
PARTS = ("schedule", "input prep", "embedding", "gemm", "attention", "norm/rotary/act",
         "forward other", "logits", "sampling", "engine update", "messaging", "detokenize")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (default: bfloat16)")
    p.add_argument("--quantization", default=None,
                   help="weight quantization method (default: none, dense weights)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's own choice, all cores)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per scenario (default: 3)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="engine token budget per step, as served (default: 2048); the "
                        "32 x 128 scenario raises it to 4096 so the batch is one step")
    p.add_argument("--ratio-rounds", type=int, default=6,
                   help="rounds of the long prompts and the 32 x 128 batch run one after "
                        "another for the ratios (default: 6; 0: from the scenarios alone)")
    p.add_argument("--top-ops", type=int, default=8, help="operators listed per scenario")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = p.parse_args()
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    return args


def cpu_summary() -> dict:
    """CPU model and the flags that pick GEMM paths (from /proc/cpuinfo)."""
    model, flags = platform.processor(), set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    return {"model": model, "flags": wanted, "cores": os.cpu_count()}


@contextmanager
def labelled(obj, attr: str, label: str):
    """Wrap ``obj.attr`` (a callable) in ``record_function(label)`` while inside."""
    fn = getattr(obj, attr)
    had_own = attr in vars(obj)

    def wrapped(*a, **kw):
        with record_function(label):
            return fn(*a, **kw)

    setattr(obj, attr, wrapped)
    try:
        yield
    finally:
        if had_own:
            setattr(obj, attr, fn)
        else:
            delattr(obj, attr)


def install_labels(engine) -> list:
    """Forward pre/post hooks that open/close labelled ranges on the model's modules."""
    runner = engine.runner
    model = runner.model
    handles = []

    def hook_module(mod: nn.Module, label: str) -> None:
        state = []

        def pre(_m, _inp):
            rf = record_function(label)
            rf.__enter__()
            state.append(rf)

        def post(_m, _inp, _out):
            state.pop().__exit__(None, None, None)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))

    lm_head = getattr(model, "lm_head", None)
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if mod is lm_head:
            continue
        if "Linear" in cls:
            hook_module(mod, "gemm")
        elif cls.endswith("RMSNorm") or "Rotary" in cls:
            hook_module(mod, "norm/rotary/act")
        elif isinstance(mod, nn.Embedding):
            hook_module(mod, "embedding")
    hook_module(model, "forward")
    return handles


def profiled_parts(prof, total_ms: float) -> dict[str, float]:
    """Inclusive CPU ms per label from a profile of one step; derived parts computed."""
    by_key = defaultdict(float)
    for evt in prof.key_averages():
        by_key[evt.key] += evt.cpu_time_total / 1000.0
    parts = {k: by_key.get(k, 0.0) for k in (
        "schedule", "embedding", "gemm", "attention", "norm/rotary/act", "logits",
        "sampling", "attention metadata")}
    parts["norm/rotary/act"] += by_key.get("silu_and_mul", 0.0)
    forward = by_key.get("forward", 0.0)
    execute = by_key.get("execute", 0.0)
    inner = sum(parts[k] for k in ("embedding", "gemm", "attention", "norm/rotary/act"))
    parts["forward other"] = max(0.0, forward - inner)
    parts["input prep"] = max(0.0, execute - forward - parts["logits"] - parts["sampling"])
    parts["engine update"] = max(0.0, total_ms - parts["schedule"] - execute)
    del parts["attention metadata"]  # inside input prep (outside the forward)
    return parts


def add_fused_parts(parts: dict[str, float], fused_ms: list[float]) -> None:
    """Split the fused CPU kernel's forward (one C++ call, opaque to the torch profiler: it
    lands in ``input prep``) by its own timers: GEMMs, KV store + attention, norms/rotary/
    activation/residual adds, and the rest of the call (``forward other``)."""
    gemm, attention, norm_act, total = fused_ms
    parts["gemm"] += gemm
    parts["attention"] += attention
    parts["norm/rotary/act"] += norm_act
    parts["forward other"] += max(0.0, total - gemm - attention - norm_act)
    parts["input prep"] = max(0.0, parts["input prep"] - total)


def top_ops(prof, n: int) -> list[tuple[str, float]]:
    ops = [(e.key, e.self_cpu_time_total / 1000.0) for e in prof.key_averages()
           if not e.key.startswith(("forward", "gemm", "attention", "norm/", "schedule",
                                    "execute", "logits", "sampling", "embedding", "silu",
                                    "input", "step", "ProfilerStep"))]
    return sorted(ops, key=lambda x: -x[1])[:n]


def random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(1000, vocab) for _ in range(n)]


def prefill_budget(batch: int, plen: int, args) -> int:
    """A prefill scenario's step budget: the 32 x 128 batch is one step (4,096 tokens),
    everything else runs as served (``--max-num-batched-tokens``)."""
    return max(batch * plen, args.max_num_batched_tokens) if batch > 1 \
        else args.max_num_batched_tokens


def prefill_steps(engine) -> tuple[float, int, list]:
    """Run the steps until every request has its first token; (seconds, steps, deltas)."""
    t0 = time.perf_counter()
    steps, deltas = 0, []
    while engine.scheduler.num_waiting or any(
            r.num_output_tokens == 0 for r in engine.requests.values()):
        deltas = engine.step()
        steps += 1
    return time.perf_counter() - t0, steps, deltas


def run_scenario(name: str, args, llm, rng, codec, tokenizer) -> dict:
    from pdserve.engine import SamplingParams
    from pdserve.messages import StepOutputs
    from pdserve.server.detokenizer import IncrementalDetokenizer

    engine = llm.engine
    vocab = engine.arch.vocab_size
    kind, _, size = name.partition("-")
    if kind == "prefill":
        batch, plen = (32, 128) if size == "32x128" else (1, int(size))
    else:
        batch, plen = int(size), 128
    engine.scheduler.max_num_batched_tokens = (
        prefill_budget(batch, plen, args) if kind == "prefill" else args.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=4096 - plen - 8, ignore_eos=True)
    counter = [0]

    def fresh_requests() -> list[str]:
        ids = []
        for _ in range(batch):
            counter[0] += 1
            rid = f"{name}-{counter[0]}"
            engine.add_request(rid, random_prompt(rng, vocab, plen), params)
            ids.append(rid)
        return ids

    def finish(ids) -> None:
        for rid in ids:
            engine.abort_request(rid)

    def one_run(profiled: bool):
        ids = fresh_requests()
        if kind == "prefill":
            if profiled:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    seconds, steps, deltas = prefill_steps(engine)
            else:
                prof = None
                seconds, steps, deltas = prefill_steps(engine)
        else:
            prefill_steps(engine)
            for _ in range(2):  # warm the decode shape
                engine.step()
            fused = getattr(engine.runner.fused_decode, "decoder", None)
            if fused is not None:
                fused.part_ms()  # the fused kernel's timers count the steps below only
            steps = 3
            if profiled:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        deltas = engine.step()
                    seconds = time.perf_counter() - t0
            else:
                prof = None
                t0 = time.perf_counter()
                for _ in range(steps):
                    deltas = engine.step()
                seconds = time.perf_counter() - t0
        finish(ids)
        return seconds, steps, deltas, prof

    one_run(False)  # warm-up
    times = []
    for _ in range(args.repeat):
        seconds, steps, deltas, _ = one_run(False)
        times.append(seconds)
    seconds = min(times)
    per_step_ms = seconds / steps * 1000
    num_tokens = batch * plen if kind == "prefill" else batch * steps
    result = {"scenario": name, "batch": batch, "prompt_len": plen, "steps": steps,
              "ms_total": seconds * 1000, "ms_per_step": per_step_ms,
              "tokens_per_s": num_tokens / seconds}

    runner = engine.runner
    with labelled(engine.scheduler, "schedule", "schedule"), \
            labelled(runner, "execute", "execute"), \
            labelled(runner.backend, "build_metadata", "attention metadata"), \
            labelled(runner.backend, "forward", "attention"), \
            labelled(runner.model, "compute_logits", "logits"), \
            (labelled(runner.fused_decode, "compute_logits", "logits")
             if getattr(runner, "fused_decode", None) is not None else nullcontext()), \
            labelled(runner, "sampler", "sampling"), \
            labelled(runner, "rejection_sampler", "sampling"):
        import pdserve.engine.models.llama as llama_mod
        with labelled(llama_mod, "silu_and_mul", "silu_and_mul"):
            handles = install_labels(engine)
            fused = getattr(runner.fused_decode, "decoder", None)
            if fused is not None:
                fused.set_timing(True)
            try:
                p_seconds, p_steps, deltas, prof = one_run(True)
            finally:
                for h in handles:
                    h.remove()
                fused_ms = fused.part_ms() if fused is not None else None
                if fused is not None:
                    fused.set_timing(False)
    parts = profiled_parts(prof, p_seconds * 1000)
    if fused_ms is not None:
        add_fused_parts(parts, fused_ms)
    parts = {k: v / p_steps for k, v in parts.items()}
    # messaging and detokenization of this step's outputs, as the workers/server do them
    msg = StepOutputs("profile", deltas)
    t0 = time.perf_counter()
    for _ in range(20):
        codec.decode_to_router(codec.encode(msg))
    parts["messaging"] = (time.perf_counter() - t0) / 20 * 1000
    detoks = [IncrementalDetokenizer(tokenizer, random_prompt(rng, vocab, 8))
              for _ in deltas]
    for d in detoks:
        d.add_tokens(random_prompt(rng, vocab, 16))
    t0 = time.perf_counter()
    for d, delta in zip(detoks, deltas):
        d.add_tokens(delta.new_token_ids)
    parts["detokenize"] = (time.perf_counter() - t0) * 1000
    result["parts_ms"] = {k: round(parts.get(k, 0.0), 3) for k in PARTS}
    result["profiled_ms_per_step"] = p_seconds / p_steps * 1000
    result["top_ops_ms"] = [(k, round(v / p_steps, 3)) for k, v in top_ops(prof, args.top_ops)]
    return result


def alternating_ratios(engine, rng, lengths: list[int], args) -> dict:
    """Prefill throughput of one prompt of each length over the 32 x 128 batch's, from runs
    taken one after another (batch, each length; ``args.ratio_rounds`` rounds): the host's
    speed drifts between the scenarios' own blocks. Prints and returns the median ratio
    per length and every round's, against the batch as one step (the scenario's) and as
    served (``--max-num-batched-tokens`` per step: two steps of 2,048 by default, faster
    per token on a 2-core Xeon, ~7,300 against ~6,400 tokens/s)."""
    from pdserve.engine import SamplingParams

    vocab = engine.arch.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def prefill_seconds(batch: int, plen: int, budget: int) -> float:
        engine.scheduler.max_num_batched_tokens = budget
        ids = [f"alt-{rng.random()}" for _ in range(batch)]
        for rid in ids:
            engine.add_request(rid, random_prompt(rng, vocab, plen), params)
        seconds = prefill_steps(engine)[0]
        for rid in ids:
            engine.abort_request(rid)
        return seconds

    bases = {"one step": prefill_budget(32, 128, args), "as served": args.max_num_batched_tokens}
    rounds = {(n, b): [] for n in lengths for b in bases}
    for _ in range(args.ratio_rounds):
        rates = {b: 32 * 128 / prefill_seconds(32, 128, budget) for b, budget in bases.items()}
        for n in lengths:
            rate = n / prefill_seconds(1, n, args.max_num_batched_tokens)
            for b in bases:
                rounds[(n, b)].append(rate / rates[b])
    out = {}
    for (n, b), rs in rounds.items():
        median = sorted(rs)[len(rs) // 2]
        key = f"prefill-{n}" if b == "one step" else f"prefill-{n} vs batch as served"
        out[key] = {"median": median, "rounds": rs}
        print(f"prefill-{n}, {len(rs)} alternating rounds: median {median:.2f}x the batch "
              f"{b} (rounds {' '.join(f'{r:.2f}' for r in rs)})")
    return out


def print_result(r: dict) -> None:
    print(f"\n== {r['scenario']}: {r['ms_per_step']:.1f} ms/step over {r['steps']} step(s), "
          f"{r['tokens_per_s']:.0f} tok/s (profiled run {r['profiled_ms_per_step']:.1f} ms/step)")
    total = sum(r["parts_ms"].values()) or 1.0
    for k, v in r["parts_ms"].items():
        print(f"   {k:<16} {v:9.2f} ms  {100 * v / total:5.1f} %")
    print("   top operators (self CPU ms per step):")
    for k, v in r["top_ops_ms"]:
        print(f"     {k:<40} {v:9.2f}")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pdserve.engine import LLM
    from pdserve.messages import MessageCodec

    kwargs = dict(dtype=args.dtype, load_progress=False, enable_prefix_caching=False,
                  max_num_batched_tokens=max(4096, args.max_num_batched_tokens),
                  max_model_len=4096)
    if args.quantization:
        kwargs["quantization"] = args.quantization
    llm = LLM(args.model, **kwargs)
    tokenizer = llm.tokenizer
    cpu = cpu_summary()
    print(f"CPU: {cpu['model']} ({cpu['cores']} cores; {' '.join(cpu['flags'])}); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}"
          f"{', ' + args.quantization if args.quantization else ''}")
    rng = random.Random(0)
    codec = MessageCodec()
    results = []
    for name in args.scenarios:
        r = run_scenario(name, args, llm, rng, codec, tokenizer)
        print_result(r)
        results.append(r)
    by = {r["scenario"]: r for r in results}
    ratios = {}
    if "prefill-32x128" in by:
        base = by["prefill-32x128"]["tokens_per_s"]
        for n in ("prefill-1500", "prefill-3000"):
            if n in by:
                print(f"\n{n}: {by[n]['tokens_per_s']:.0f} tok/s = "
                      f"{by[n]['tokens_per_s'] / base:.2f}x the 32 x 128 batch ({base:.0f} tok/s)")
        long_ones = [int(n.split("-")[1]) for n in ("prefill-1500", "prefill-3000") if n in by]
        if long_ones and args.ratio_rounds > 0:
            ratios = alternating_ratios(llm.engine, rng, long_ones, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "dtype": args.dtype, "quantization": args.quantization,
                       "results": results, "alternating_ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
