"""Router sends to workers that are gone: logged once, never an unretrieved future."""

from __future__ import annotations

import asyncio
import gc
import logging

from pdserve.messages import AbortRequests
from pdserve.router.router import Router


def test_send_to_a_worker_that_is_gone_is_logged_not_raised(caplog):
    """A ROUTER_MANDATORY send to an unknown identity fails with EHOSTUNREACH; with
    zmq.asyncio that error sits on the returned future (it was left unretrieved, and
    asyncio printed a traceback for every send to a killed prefill worker)."""
    loop_errors: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
        router = Router("tcp://127.0.0.1:0")
        try:
            router.send("prefill-gone", AbortRequests(["r1"]))
            await asyncio.sleep(0.05)  # let the send run and the callback fire
        finally:
            await router.stop()
        gc.collect()  # an unretrieved failed future reports when it is collected
        await asyncio.sleep(0)

    with caplog.at_level(logging.WARNING, logger="pdserve.router.worker_socket"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if "prefill-gone" in r.getMessage()]
    assert len(warnings) == 1 and "send to prefill-gone failed" in warnings[0]
    assert loop_errors == []
