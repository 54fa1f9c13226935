"""A/B in one process: fp32 prefill attention through the AVX2 kernel vs torch's flash."""
import random, sys, time, torch
sys.path.insert(0, "/work/main/bench")
from profile_step import prefill_steps, random_prompt
from pdserve.engine import LLM, SamplingParams
import pdserve.engine.kernels.cpu_prefill_attention as cpa
llm = LLM(None, dtype="bfloat16", load_progress=False, enable_prefix_caching=False,
          max_num_batched_tokens=4096, max_model_len=4096)
eng = llm.engine; rng = random.Random(0); vocab = eng.arch.vocab_size
params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
def run(batch, plen, budget):
    eng.scheduler.max_num_batched_tokens = budget
    ids = [f"r{rng.random()}" for _ in range(batch)]
    for rid in ids: eng.add_request(rid, random_prompt(rng, vocab, plen), params)
    s = prefill_steps(eng)[0]
    for rid in ids: eng.abort_request(rid)
    return batch * plen / s
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
lens = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "3000").split(",")]
run(32, 128, 2048); run(1, 3000, 2048)
for r in range(rounds):
    out = []
    for mode in ("kernel", "torch"):
        cpa._state["torch.float32"] = mode == "kernel"
        b1 = run(32, 128, 4096); b2 = run(32, 128, 2048)
        ls = [run(1, n, 2048) for n in lens]
        out.append(f"{mode}: batch {b1:.0f}/{b2:.0f} " + " ".join(
            f"{n}: {x:.0f} ({x/b1:.2f}/{x/b2:.2f})" for n, x in zip(lens, ls)))
    print(" | ".join(out), flush=True)
