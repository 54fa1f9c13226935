"""The router's liveness loop: every quarter heartbeat period it measures how late it woke
(the event loop's lag, ``pdserve:router_loop_lag_seconds``), handles every message already
queued on the router socket, checks the requests' deadlines, and only then drops workers
that stayed silent too long.

NOTE (a slow router never kills a worker): the router runs in the API server's event loop,
which a burst of requests can keep busy for seconds. Meanwhile libzmq's I/O thread keeps
queueing the workers' heartbeats, but the loop may not have read them. So before judging,
this loop reads and handles everything queued (in order: the receive loop reads the same
way, one message handled before the next is read); if more than
:data:`MAX_DRAIN_MESSAGES` are queued the router is behind and judges no one this tick. And
silence is measured net of the lag: a worker must have been silent for the whole window on
top of the time the loop itself could not run (:meth:`WorkerRegistry.remove_dead`'s
``grace_s``), which delays a real death by at most one tick.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pdserve.memory import IdleTrimmer
from pdserve.router.registry import WorkerInfo

if TYPE_CHECKING:
    from pdserve.router.router import Router

logger = logging.getLogger(__name__)

#: Queued messages one liveness tick handles at most before judging anyone.
MAX_DRAIN_MESSAGES = 10_000
#: Liveness ticks per heartbeat period.
TICKS_PER_HEARTBEAT = 4


class LivenessLoop:
    """The liveness loop of one router (see the module docstring).

    Args:
        router: the router whose socket, registry and recovery it drives.
    """

    def __init__(self, router: Router) -> None:
        self.router = router
        self.trimmer = IdleTrimmer()

    @property
    def period_s(self) -> float:
        """Seconds between ticks (a quarter of the heartbeat period)."""
        return self.router.registry.heartbeat_interval_s / TICKS_PER_HEARTBEAT

    async def run(self) -> None:
        """Tick for ever; each tick's lag is how much later than asked its sleep ended."""
        while True:
            period_s = self.period_s
            started_s = time.monotonic()
            await asyncio.sleep(period_s)
            self.tick(max(0.0, time.monotonic() - started_s - period_s))

    def tick(self, lag_s: float) -> list[WorkerInfo]:
        """Record ``lag_s`` (seconds the loop woke late), handle the queued messages, check
        deadlines, return idle memory, and drop the workers silent for longer than the
        window plus ``lag_s``; returns the dropped workers."""
        router = self.router
        router.observe("router_loop_lag", lag_s)
        is_caught_up = router.drain(MAX_DRAIN_MESSAGES) < MAX_DRAIN_MESSAGES
        router.recovery.check_deadlines()
        self.trimmer.tick(bool(router.handles), time.monotonic())
        if not is_caught_up:
            logger.warning("router is behind (over %d messages queued, loop %.2f s late); "
                           "judging no worker this tick", MAX_DRAIN_MESSAGES, lag_s)
            return []
        dead = router.registry.remove_dead(grace_s=lag_s)
        for worker in dead:
            router.recovery.on_worker_lost(worker)
        return dead
