"""The FastAPI app: thin route handlers over :mod:`serving_chat` / :mod:`serving_completion`."""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pdserve import __version__
from pdserve.server.errors import APIError
from pdserve.server.protocol import ModelCard, ModelList, error_body
from pdserve.server.serving_chat import create_chat_completion
from pdserve.server.serving_completion import create_completion
from pdserve.server.serving_common import check_model
from pdserve.server.serving_tokenize import detokenize, tokenize
from pdserve.server.state import ServerState
from pdserve.server.worker_scrape import WorkerMetricsScraper, render_merged

logger = logging.getLogger(__name__)

#: Status recorded for a request whose client went away first (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


async def _unless_disconnected(request: Request, handler: Awaitable[Response]) -> Response:
    """Await ``handler``, cancelling it if the client disconnects first.

    Cancelling a non-streamed generation aborts its requests in the worker, which frees
    their KV blocks (a streamed response notices the disconnect by itself). The body has
    been read by now, so the next ASGI message can only be ``http.disconnect``.
    """
    work = asyncio.ensure_future(handler)
    gone = asyncio.ensure_future(request.receive())
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        is_abandoned = not work.done()
        if is_abandoned:
            work.cancel()
    if is_abandoned:
        await asyncio.gather(work, return_exceptions=True)  # let it abort its requests
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return work.result()


#: ``Retry-After`` (seconds) on the 503 a draining server answers new requests with.
DRAIN_RETRY_AFTER_S = 1

#: Seconds an idle HTTP keep-alive connection stays open: longer than clients keep theirs
#: (httpx 5 s, aiohttp 15 s), so the client closes first. At uvicorn's default of 5 s the
#: server closed connections an aiohttp client was about to reuse: one of 100 W3 requests
#: ended in "connection reset by peer" (2-core Xeon, a 0.7 req/s Poisson load).
KEEP_ALIVE_S = 75
#: Paths that need the API key when one is set: the API, its tokenizer endpoints and its
#: schema pages. ``/health``, ``/version`` and ``/metrics`` stay open for probes and scrapers.
PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json")


def build_app(state: ServerState) -> FastAPI:
    """Create the app; the router starts and stops with it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.router.start()
        if state.listen_when_ready:  # uvicorn listens on the socket after this startup
            from pdserve.front_doors import wait_for_decode_worker
            await wait_for_decode_worker(state)
        yield
        # workers ``serve`` started are told to exit before the socket closes (a closed
        # connection alone reads as a lost router to them)
        await state.router.stop(shutdown_workers=state.num_workers_expected > 0)
        if state.worker_scraper is not None:
            await state.worker_scraper.aclose()

    app = FastAPI(title="pdserve", version=__version__, lifespan=lifespan)
    app.state.pdserve = state
    _add_error_handlers(app)
    _add_middleware(app, state)
    _add_api_routes(app, state)
    _add_probe_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error becomes an OpenAI-style body: :class:`APIError` with its own status,
    HTTP errors (404, 405) and invalid bodies as 4xx, anything else as a logged 500."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=exc.headers)  # e.g. Allow on a 405

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect):
        # the client left while sending its body: nothing was started, nobody reads this
        logger.debug("client disconnected before its request body arrived")
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error")
        return JSONResponse(error_body("internal server error", "internal_server_error"),
                            status_code=500)


def _add_middleware(app: FastAPI, state: ServerState) -> None:
    """The API key check on :data:`PROTECTED_PREFIXES` (401), then the drain check: a
    draining server answers every POST with 503 and ``Retry-After``."""
    app.add_middleware(_GateMiddleware, state=state)


class _GateMiddleware:
    """:func:`_add_middleware`'s checks as a plain ASGI middleware: a request that passes
    goes to the app with its own ``receive`` and ``send``. (Starlette's
    ``@app.middleware("http")`` runs every streamed chunk through an anyio memory stream
    and its disconnect watcher: with two of them, ~35 % of the API server's CPU time in a
    32-stream run, 2-core Xeon, py-spy.)"""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(Request(scope))
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, request: Request) -> Response | None:
        state = self.state
        if state.api_key and request.url.path.startswith(PROTECTED_PREFIXES):
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), state.api_key.encode()):
                return APIError(401, "Invalid or missing API key.", code="invalid_api_key"
                                ).response()
        # a draining server still says 401 to a request without the key
        if state.draining and request.method == "POST":
            response = APIError(503, "the server is shutting down; retry on another "
                                     "replica", code="service_unavailable").response()
            response.headers["Retry-After"] = str(DRAIN_RETRY_AFTER_S)
            return response
        return None


def _add_api_routes(app: FastAPI, state: ServerState) -> None:
    """The OpenAI API (chat and text completions, the model list) and the tokenizer
    endpoints. A generation whose client disconnects is cancelled."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        raw = await request.body()
        return await _unless_disconnected(request, create_chat_completion(state, raw))

    @app.post("/v1/completions")
    async def completions(request: Request):
        raw = await request.body()
        return await _unless_disconnected(request, create_completion(state, raw))

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await tokenize(state, await request.body())

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await detokenize(state, await request.body())

    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=state.model_name, created=state.created,
                         max_model_len=state.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):  # OpenAI's "retrieve model"; 404 for any other name
        check_model(state, model_id)
        return JSONResponse(ModelCard(id=state.model_name, created=state.created,
                                      max_model_len=state.max_model_len).model_dump(mode="json"))


def _add_probe_routes(app: FastAPI, state: ServerState) -> None:
    """What orchestrators and scrapers poll, open without the API key: ``/health``
    (readiness), ``/live`` (liveness), ``/version`` and ``/metrics``."""

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse(error_body("draining: finishing in-flight requests before "
                                           "shutting down", "service_unavailable"),
                                status_code=503)
        if not state.router.is_healthy:
            return JSONResponse(error_body("the router is restarting a failed loop",
                                           "service_unavailable"), status_code=503)
        starting = state.num_workers_expected - len(state.router.registry.ever_registered)
        if starting > 0:
            return JSONResponse(error_body(f"starting: {starting} of the workers have not "
                                           "registered yet", "service_unavailable"),
                                status_code=503)
        if state.router.alive_workers("decode"):
            return Response(status_code=200)
        return JSONResponse(error_body("no worker is registered and alive",
                                       "service_unavailable"), status_code=503)

    @app.get("/live")
    async def live():
        """Liveness (Kubernetes ``livenessProbe``): 200 while the router's loops run,
        whatever the workers do; 503 while one is being restarted."""
        if state.router.is_healthy:
            return Response(status_code=200)
        return JSONResponse(error_body("the router is restarting a failed loop",
                                       "service_unavailable"), status_code=503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(await _scrape_metrics(state),
                        media_type="text/plain; version=0.0.4")


async def _scrape_metrics(state: ServerState) -> bytes:
    """Fill the per-worker and load gauges from the alive workers' last heartbeats, then
    render every series in the Prometheus text format; with ``scrape_worker_metrics``, the
    workers' own series merged in (:mod:`pdserve.server.worker_scrape`)."""
    workers = state.router.alive_workers()
    state.metrics.set_worker_load(workers)
    state.metrics.add_spec_decode_counts(workers)
    workers = [w for w in workers if w.info.role == "decode"]
    loads = [w.load for w in workers if w.load is not None]
    usage = max((lo.kv_cache_usage for lo in loads), default=0.0)
    state.metrics.set_load(sum(lo.num_running for lo in loads),
                           sum(lo.num_waiting for lo in loads), usage)
    if not state.scrape_worker_metrics:
        return state.metrics.render()
    if state.worker_scraper is None:
        state.worker_scraper = WorkerMetricsScraper(state.metrics.observe_worker_scrape_failure)
    families = await state.worker_scraper.families(
        {w.worker_id: w.info.metrics_address for w in state.router.alive_workers()
         if w.info.metrics_address})
    return render_merged(state.metrics.registry.collect(), families)
