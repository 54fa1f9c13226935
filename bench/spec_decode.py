"""Decode speed with and without speculative decoding, same prompts, same run.

SmolLM2-135M-Instruct on CPU: chat prompts built from held-out Brown-corpus excerpts and
generic questions, greedy, 64 output tokens, at batch 1 and batch 16. For each proposer
(none, ngram, draft = the target itself, eagle = the shipped head) prints output tokens/s,
the ratio to no speculation measured in the same run, the mean acceptance length and the
acceptance rate per draft position.

    python bench/spec_decode.py [--methods none,ngram,eagle,eagle:0.3,draft] [--batch-sizes 1,16]
        [--rounds R] [--stop-at-eos] [--output-len N] [--num-prompts N]
        [--eagle-model DIR] [--prompt-set questions|brown-heldout]
        [--num-speculative-tokens K] [--draft-confidence C] [--disable-by-batch-size N]

``questions`` are the eight generic requests below (none comes from EAGLE training data);
``brown-heldout`` are chat prompts built as ``train-eagle`` builds its held-out ones (from
Brown-corpus files it never trains on).
"""

from __future__ import annotations

import argparse
import time

import torch

QUESTIONS = [
    "Summarize in one sentence: the committee met on Tuesday to discuss the new budget, "
    "which raises spending on schools and roads while cutting administrative costs.",
    "Continue this text: It was late in the evening when the train finally pulled into the "
    "small station, and the few passengers who stepped down",
    "Explain what photosynthesis is to a ten-year-old.",
    "Write three short tips for staying focused while studying.",
    "What are the main differences between a city and a village?",
    "Describe the water cycle in a few sentences.",
    "Give a short definition of democracy.",
    "Why do leaves change colour in autumn?",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="none,ngram,eagle,draft",
                   help="comma-separated: none, ngram, eagle, draft (the target drafting for "
                        "itself); NAME:C sets a model drafter's draft confidence to C "
                        "(default: %(default)s)")
    p.add_argument("--batch-sizes", default="1,16",
                   help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=64,
                   help="most tokens per answer (default: %(default)s)")
    p.add_argument("--disable-by-batch-size", type=int, default=0,
                   help="--speculative-disable-by-batch-size for every proposer (0 = never)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every method this many times, taking turns; best of each")
    p.add_argument("--num-prompts", type=int, default=8,
                   help="prompts run one after another at batch 1 (earlier versions of this "
                        "script ran only the first one there)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="end answers at EOS (tok/s over the tokens really generated; the "
                        "default ignores EOS so every method emits the same count)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="k, drafts per verification pass (default: %(default)s)")
    p.add_argument("--draft-confidence", type=float, default=0.0,
                   help="--speculative-draft-confidence for the model drafters")
    p.add_argument("--dtype", default="bfloat16",
                   help="target model dtype (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch CPU threads (default: %(default)s)")
    p.add_argument("--eagle-model", default="default",
                   help="EAGLE head folder ('default': the shipped head)")
    p.add_argument("--prompt-set", choices=("questions", "brown-heldout"), default="questions",
                   help="8 generic questions, or Brown-corpus prompts held out of the "
                        "shipped head's training (default: %(default)s)")
    return p.parse_args()


def prompt_texts(prompt_set: str) -> list[str]:
    """The user messages of the run (see the module docstring)."""
    if prompt_set == "questions":
        return QUESTIONS
    from pdserve.offline.eagle.data import load_prompt_specs

    return [s.text for s in load_prompt_specs("builtin", 1, 16, seed=1) if s.is_held_out]


def build(method: str, args):
    """The LLM for one ``--methods`` entry: ``name`` or ``name:C`` (a model drafter with
    draft confidence C; plain ``name`` takes ``--draft-confidence``)."""
    from pdserve.engine import LLM
    from pdserve.engine.loader.default_model import resolve_model

    name, _, conf = method.partition(":")
    model = {"none": None, "ngram": None, "eagle": args.eagle_model,
             "draft": str(resolve_model(None))}[name]
    confidence = float(conf) if conf else (args.draft_confidence if model else 0.0)
    return LLM(None, dtype=args.dtype, load_progress=False, speculative_method=name,
               num_speculative_tokens=args.num_speculative_tokens, speculative_model=model,
               speculative_draft_confidence=confidence,
               speculative_disable_by_batch_size=args.disable_by_batch_size if name != "none"
               else 0)


def measure(llm, batch_size: int, args, prompts_text: list[str]) -> tuple[float, object]:
    """Output tok/s of one pass over the prompts, and the pass's spec-decode stats."""
    from pdserve.engine import SamplingParams

    # batch 1: every prompt of the set, one at a time; batch N: the first N (cycled)
    texts = prompts_text[:args.num_prompts] if batch_size == 1 else \
        (prompts_text * (batch_size // len(prompts_text) + 1))[:batch_size]
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": q}]) for q in texts]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                            ignore_eos=not args.stop_at_eos)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), detokenize=False)  # warm-up
    llm.engine.spec_stats.__init__(args.num_speculative_tokens)
    t0 = time.perf_counter()
    total = 0
    # batch 1: one request at a time, so every step is a batch of one
    groups = [[p] for p in prompts] if batch_size == 1 else [prompts]
    for group in groups:
        outs = llm.generate(group, params, detokenize=False)
        total += sum(len(o.outputs[0].token_ids) for o in outs)
    return total / (time.perf_counter() - t0), llm.engine.spec_stats


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    texts = prompt_texts(args.prompt_set)
    llms = {m: build(m, args) for m in methods} if args.rounds > 1 else None
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        best: dict[str, float] = {}
        acc: dict[str, str] = {}
        # rounds > 1: methods take turns each round (all models stay loaded), so a slow
        # spell of a shared machine hits them alike; the best round of each is reported
        for _ in range(args.rounds):
            for method in methods:
                llm = llms[method] if llms else build(method, args)
                tok_s, stats = measure(llm, bs, args, texts)
                best[method] = max(best.get(method, 0.0), tok_s)
                if stats.num_drafts:
                    per_pos = [n / stats.num_drafts for n in stats.num_accepted_tokens_per_pos]
                    acc[method] = (f"acceptance length {stats.mean_acceptance_length:.2f}, "
                                   "per position " + " ".join(f"{x:.2f}" for x in per_pos))
                del llm
        base = best.get("none")
        for method in methods:
            ratio = f"{best[method] / base:.2f}x" if base else "-"
            print(f"batch {bs:3d} {method:9s}: {best[method]:7.1f} tok/s ({ratio} of none) "
                  f"{acc.get(method, '')}", flush=True)


if __name__ == "__main__":
    main()
