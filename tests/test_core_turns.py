"""Workers on the same cores take turns at their steps (pdserve.core_turns): real processes
holding real flocks, alternation under contention, a killed holder's turn freed, and the
plan ``serve`` makes (turns only where every worker shares the cores)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from pdserve.core_turns import (
    PREFILL_TURN_TOKENS,
    CoreTurns,
    core_turns_argv,
    prefill_step_tokens,
    share_all_cores,
)
from pdserve.cpu_affinity import WorkerCpus, plan_worker_cpus

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
    assert prefill_step_tokens(2048, "/tmp/x") == PREFILL_TURN_TOKENS
    assert prefill_step_tokens(512, "/tmp/x") == 512
    assert prefill_step_tokens(2048, None) == 2048
