"""Top-k/top-p truncation on real next-token distributions: the sampler's candidate cut
(``apply_top_k_top_p``: each row's 256 most likely tokens, the whole vocabulary sorted only
for rows whose nucleus may reach past them) against one sort of every row
(``sort_top_k_top_p``, what the sampler did before), run alternately in one process.

The rows are SmolLM2-135M-Instruct's logits (transformers, fp32, from the converted default
model folder) at every position of the held Brown text ``cg22``, divided by the temperature.
Prints, per batch size and (temperature, top_p): ms per call for both, the speed-up, the
share of rows that needed the full sort, and whether both kept the same tokens.

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
    from pdserve.engine.sample.logits_processors import (NUM_TOP_CANDIDATES,
                                                         apply_top_k_top_p, sort_top_k_top_p)

    args = parse_args()
    torch.set_num_threads(args.threads)
    logits = real_logits(args.tokens)
    vocab = logits.shape[1]
    print(f"{logits.shape[0]} rows of {vocab} logits; {NUM_TOP_CANDIDATES} candidates; "
          f"{args.threads} thread(s)")
    print(f"{'rows':>4} {'T':>4} {'top_p':>5} {'cut ms':>8} {'sort ms':>8} {'speed-up':>8} "
          f"{'sorted rows':>11} {'same':>5}")
    for setting in args.settings.split(","):
        temperature, top_p = (float(x) for x in setting.split(":"))
        scaled = logits / temperature
        # rows whose nucleus is larger than the candidates: the ones sorted whole
        probs = scaled.softmax(dim=-1).topk(NUM_TOP_CANDIDATES, dim=-1).values
        sorted_share = (probs.sum(dim=-1) < top_p).float().mean().item()
        all_p = torch.full((len(scaled),), top_p)
        same = torch.equal(apply_top_k_top_p(scaled, None, all_p),
                           sort_top_k_top_p(scaled, torch.full((len(scaled),), vocab), all_p))
        for batch in (int(b) for b in args.batches.split(",")):
            rows = scaled[:batch]
            p = torch.full((batch,), top_p)
            k = torch.full((batch,), vocab)
            cut = best_ms(lambda: apply_top_k_top_p(rows, None, p), args.repeat)
            full = best_ms(lambda: sort_top_k_top_p(rows, k, p), args.repeat)
            print(f"{batch:>4} {temperature:>4} {top_p:>5} {cut:>8.2f} {full:>8.2f} "
                  f"{full / cut:>7.1f}x {sorted_share:>10.1%} {str(same):>5}")


if __name__ == "__main__":
    main()
