import time, torch, collections
from pdserve.engine import LLM, SamplingParams
from pdserve.engine import model_runner as mr
from pdserve.engine.spec_decode import model_proposer as mp
T = collections.defaultdict(float); N = collections.Counter()
def wrap(cls, name, key=None):
    f = getattr(cls, name)
    def g(self, *a, **k):
        t = time.perf_counter(); r = f(self, *a, **k); T[key or name] += time.perf_counter() - t; N[key or name] += 1; return r
    setattr(cls, name, g)
def wrap_fwd():
    f = mr.ModelRunner.forward
    def g(self, input_ids, *a, **k):
        t = time.perf_counter(); r = f(self, input_ids, *a, **k); key = f"forward[{len(input_ids)}]"
        T[key] += time.perf_counter() - t; N[key] += 1; return r
    mr.ModelRunner.forward = g
wrap_fwd()
for n in ("compute_logits", "_verify_drafts", "_sample_plain", "execute"): wrap(mr.ModelRunner, n)
for n in ("propose", "_run_chain", "_run_ingest", "_sample"): wrap(mp.ModelProposer, n, "prop." + n)
for spec in ("eagle", "none"):
    kw = dict(speculative_method="eagle", speculative_model="default", num_speculative_tokens=2,
              speculative_disable_by_batch_size=0) if spec == "eagle" else {}
    llm = LLM(None, dtype="bfloat16", load_progress=False, max_model_len=1024, **kw)
    p = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    ids = llm.tokenizer.encode("Explain what photosynthesis is to a ten-year-old.")
    llm.generate([ids], p); T.clear(); N.clear()
    t = time.perf_counter(); llm.generate([ids], p); dt = time.perf_counter() - t
    print(f"== {spec}: {dt*1e3/128:.2f} ms/token")
    for k in sorted(T): print(f"   {k:24s} {T[k]*1e3:8.1f} ms  n={N[k]:4d}  {T[k]*1e3/N[k]:.2f} ms each")
    del llm
