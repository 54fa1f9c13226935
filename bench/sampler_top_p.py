"""Top-k/top-p truncation on real next-token distributions: the sampler's candidate cut
(``apply_top_k_top_p``: each row's 256, then 4,096 most likely tokens, the whole vocabulary
sorted only for rows whose nucleus reaches past them) against one sort of every row
(``sort_top_k_top_p``, what the sampler did before), run alternately in one process.

The rows are SmolLM2-135M-Instruct's logits (transformers, fp32, from the converted default
model folder) at every position of the held Brown text ``cg22``, divided by the temperature.
Prints, per batch size and (temperature, top_p): ms per call for both, the speed-up, the
shares of the rows settled by 4,096 candidates and by the full sort, and how many of the
rows each method truncates unlike a float64 sort (the exact nucleus).

    python bench/sampler_top_p.py [--batches 1,8,32] [--repeat 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32", help="comma-separated rows per call")
    p.add_argument("--settings", default="1.0:0.9,0.7:0.95,1.0:0.95,1.3:0.9",
                   help="comma-separated temperature:top_p")
    p.add_argument("--tokens", type=int, default=512, help="positions of the text used")
    p.add_argument("--repeat", type=int, default=20, help="timed calls of each (best kept)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    return p.parse_args()


def real_logits(num_tokens: int) -> torch.Tensor:
    """``[num_tokens, V]`` fp32 next-token logits of the default model on held text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.engine.loader import resolve_model
    from pdserve.offline.perplexity import held_text

    folder = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(held_text(), return_tensors="pt")["input_ids"][:, :num_tokens]
    with torch.no_grad():
        return model(ids).logits[0].float()


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    from pdserve.engine.sample.logits_processors import (TOP_CANDIDATE_SIZES,
                                                         apply_top_k_top_p, sort_top_k_top_p)

    args = parse_args()
    torch.set_num_threads(args.threads)
    logits = real_logits(args.tokens)
    vocab = logits.shape[1]
    small, large = TOP_CANDIDATE_SIZES
    print(f"{logits.shape[0]} rows of {vocab} logits; candidates {TOP_CANDIDATE_SIZES}; "
          f"{args.threads} thread(s)")
    print(f"{'rows':>4} {'T':>4} {'top_p':>5} {'cut ms':>8} {'sort ms':>8} {'speed-up':>8} "
          f"{'by ' + str(large):>8} {'by sort':>8} {'cut off':>7} {'sort off':>8}")
    for setting in args.settings.split(","):
        temperature, top_p = (float(x) for x in setting.split(":"))
        scaled = logits / temperature
        # the nucleus size of each row: which candidate size settles it
        probs = scaled.double().softmax(dim=-1).sort(dim=-1, descending=True).values
        size = ((probs.cumsum(dim=-1) - probs) < top_p).sum(dim=-1)
        by_large = ((size > small) & (size <= large)).double().mean().item()
        by_sort = (size > large).double().mean().item()
        all_p = torch.full((len(scaled),), top_p)
        all_k = torch.full((len(scaled),), vocab)
        exact = sort_top_k_top_p(scaled.double(), all_k, all_p.double()).isfinite()
        cut_off = (apply_top_k_top_p(scaled, None, all_p).isfinite() != exact).any(dim=1)
        sort_off = (sort_top_k_top_p(scaled, all_k, all_p).isfinite() != exact).any(dim=1)
        for batch in (int(b) for b in args.batches.split(",")):
            rows = scaled[:batch]
            p = torch.full((batch,), top_p)
            k = torch.full((batch,), vocab)
            cut = best_ms(lambda: apply_top_k_top_p(rows, None, p), args.repeat)
            full = best_ms(lambda: sort_top_k_top_p(rows, k, p), args.repeat)
            print(f"{batch:>4} {temperature:>4} {top_p:>5} {cut:>8.2f} {full:>8.2f} "
                  f"{full / cut:>7.1f}x {by_large:>8.1%} {by_sort:>8.1%} "
                  f"{int(cut_off.sum()):>7} {int(sort_off.sum()):>8}")


if __name__ == "__main__":
    main()
