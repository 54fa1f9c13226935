"""Offline acceptance length of EAGLE heads on train-eagle's held-out set, made in a chosen dtype.

``pdserve train-eagle`` prints the held-out acceptance of the head it trains, on held-out
sequences made in its ``--data-dtype``. This script makes only that held-out part of a
recipe (the held-out Brown-corpus prompts' answers, and the held-out self-written requests,
sampled among all of them as train-eagle samples them, with their answers), in float32 (as
the heads of runs 1-8 were made) or bfloat16 (runs 9 on), computes the target's features in
the same dtype, and prints the mean acceptance length (greedy chain drafting, k drafts,
Li et al. 2024) of each head on it, on its two parts, and on two sets of requests no head
trained on: the 8 of ``tests/test_eagle_smollm2_head.py`` and the 8 questions of
``bench/spec_decode.py`` (float32 answers of 128 tokens). The figures of several heads come
from one set, so they compare.

    python bench/eagle_heldout.py --heads default,/path/to/head [--data-dtype float32]
        [--num-prompts 2000 --num-held-out 64 --self-written-prompts 2400] [--k 4]

The self-written requests are cached where train-eagle keeps them (a later train-eagle run
with the same recipe reuses them), the held-out features in ``eagle-data/heldout-*``. On the
2-core CPU of session 11 the float32 set of the shipped recipe took 19 min (the 4,050
requests sampled to find the 2,700 distinct ones: 15 min), each head then under a minute.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="default",
                   help="comma-separated EAGLE head folders; 'default' is the shipped head "
                        "(default: %(default)s)")
    p.add_argument("--data-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype the held-out answers and features are made in "
                        "(default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=2000,
                   help="train-eagle's --num-prompts (decides nothing held out, but the cache "
                        "key of the text answers; default: %(default)s)")
    p.add_argument("--num-held-out", type=int, default=64,
                   help="held-out Brown-corpus prompts (default: %(default)s)")
    p.add_argument("--self-written-prompts", type=int, default=2400,
                   help="train-eagle's --self-written-prompts; one in eight more are held "
                        "out (default: %(default)s)")
    p.add_argument("--max-answer-tokens", type=int, default=96, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="train-eagle's --seed (default: 0)")
    p.add_argument("--k", type=int, default=4, help="drafts per round (default: %(default)s)")
    p.add_argument("--no-fresh", action="store_true",
                   help="skip the two sets of fresh requests")
    return p.parse_args()


def held_out_features(cfg, model_path: Path, log=print) -> tuple[list, int]:
    """The held-out sequences' target features (text prompts first) and the text count,
    cached by what determines them."""
    from pdserve.engine.loader.default_model import default_cache_dir
    from pdserve.offline.eagle.data import (PromptSpec, data_cache_key,
                                                       generate_answers,
                                                       generate_self_written_prompts,
                                                       load_prompt_specs, self_written_specs)
    from pdserve.offline.eagle.features import (TargetFeatures,
                                                           compute_target_features,
                                                           load_target_model)
    from pdserve.offline.eagle.train import (DATA_DTYPES, cached_requests,
                                                        lazy_target_llm, self_written_cache)

    specs = [s for s in load_prompt_specs(cfg.data, cfg.num_prompts, cfg.num_held_out,
                                          cfg.hyper.seed) if s.is_held_out]
    sw, _ = self_written_cache(cfg, model_path)
    key = data_cache_key(model_path, [*specs, PromptSpec(sw.name, True, True)],
                         cfg.max_answer_tokens, cfg.data_dtype)
    cache = default_cache_dir() / "eagle-data" / f"heldout-{key}.features.pt"
    if cache.is_file():
        feats = [TargetFeatures(**d) for d in torch.load(cache, weights_only=True)]
        return feats, len(specs)
    llm = lazy_target_llm(cfg, model_path)
    t0 = time.perf_counter()
    text = generate_answers(llm(), specs, cfg.max_answer_tokens, use_tqdm=False)
    count, held = cfg.self_written_prompts, max(1, cfg.self_written_prompts // 8)
    requests = cached_requests(sw, count + held, lambda: generate_self_written_prompts(
        llm(), count + held, cfg.hyper.seed, use_tqdm=True), log)
    log(f"held-out text answers and {count + held} self-written requests: "
        f"{time.perf_counter() - t0:.0f} s")
    written = generate_answers(llm(), [s for s in self_written_specs(requests, held)
                                       if s.is_held_out], cfg.max_answer_tokens,
                               use_tqdm=False)
    seqs = text + written
    target = load_target_model(model_path, max(len(s.prompt_ids) + len(s.answer_ids)
                                               for s in seqs) + 8,
                               DATA_DTYPES[cfg.data_dtype], cfg.device)
    feats = compute_target_features(target, seqs, use_tqdm=False)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    torch.save([asdict(f) for f in feats], tmp)
    tmp.replace(cache)
    log(f"held-out set: {len(text)} text + {len(written)} self-written sequences, "
        f"{sum(len(f.token_ids) for f in feats)} tokens, {time.perf_counter() - t0:.0f} s")
    return feats, len(text)


def fresh_features(model_path: Path, target) -> dict[str, list]:
    """Features of float32 greedy 128-token answers to two sets of requests no head saw."""
    from spec_decode import QUESTIONS
    from test_eagle_smollm2_head import FRESH_REQUESTS

    from pdserve.engine import LLM, SamplingParams
    from pdserve.offline.eagle.data import DistillSequence
    from pdserve.offline.eagle.features import compute_target_features

    llm = LLM(str(model_path), dtype="float32", load_progress=False, max_model_len=1024)
    sets = {}
    for name, texts in (("test's fresh requests", FRESH_REQUESTS),
                        ("bench questions", QUESTIONS)):
        prompts = [llm.chat_prompt_ids([{"role": "user", "content": t}]) for t in texts]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=128),
                            detokenize=False, use_tqdm=False)
        seqs = [DistillSequence(p, list(o.outputs[0].token_ids), True)
                for p, o in zip(prompts, outs)]
        sets[name] = compute_target_features(target, seqs, use_tqdm=False)
    return sets


def main() -> None:
    args = parse_args()
    from pdserve.engine.attention.torch_backend import TorchAttentionBackend
    from pdserve.engine.loader.default_model import resolve_model
    from pdserve.engine.spec_decode.eagle import load_eagle_model
    from pdserve.engine.spec_decode.eagle_proposer import eagle_head_path
    from pdserve.offline.eagle.acceptance import estimate_acceptance
    from pdserve.offline.eagle.features import load_target_model
    from pdserve.offline.eagle.trainer import TrainHyperParams
    from pdserve.offline.eagle.train import TrainEagleConfig

    cfg = TrainEagleConfig(model=None, data="builtin", out=Path(tempfile.mkdtemp()),  # unused
                           num_prompts=args.num_prompts, num_held_out=args.num_held_out,
                           max_answer_tokens=args.max_answer_tokens,
                           self_written_prompts=args.self_written_prompts,
                           data_dtype=args.data_dtype, hyper=TrainHyperParams(seed=args.seed))
    folders = {}
    for name in args.heads.split(","):  # before any data is made
        folders[name] = eagle_head_path(name)
        if not (folders[name] / "config.json").is_file():
            print(f"eagle_heldout.py: error: --heads {name!r}: no EAGLE head there "
                  f"({folders[name]} has no config.json)", file=sys.stderr)
            sys.exit(2)
    model_path = resolve_model(None)
    held, num_text = held_out_features(cfg, model_path)
    target = load_target_model(model_path, 1024, torch.float32, "cpu")
    sets = {f"held out ({args.data_dtype})": held, "  of it: text prompts": held[:num_text],
            "  of it: self-written requests": held[num_text:]}
    if not args.no_fresh:
        sets.update(fresh_features(model_path, target))
    for name, folder in folders.items():
        head = load_eagle_model(folder, target,
                                TorchAttentionBackend(torch.device("cpu")), 1024,
                                torch.float32).eval()
        print(f"head {name}:")
        for label, data in sets.items():
            est = estimate_acceptance(head, data, num_speculative_tokens=args.k)
            rates = " ".join(f"{r:.3f}" for r in est.acceptance_rates)
            print(f"  {label:34s} acceptance length {est.mean_acceptance_length:.4f} at k={args.k}"
                  f" ({len(data)} sequences; per position {rates})", flush=True)


if __name__ == "__main__":
    main()
