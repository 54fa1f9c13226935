"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk.

Backends: ``openai-chat`` (``/v1/chat/completions``, the prompt as one user message) and
``openai`` (``/v1/completions``). ``stream_options.include_usage`` asks for a final usage
chunk, the source of the token counts; servers that send none are counted by re-tokenizing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from pdserve.benchmark.datasets import SampleRequest

#: Default endpoint path per backend.
BACKEND_ENDPOINTS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run shares.

    Attributes:
        backend: a key of :data:`BACKEND_ENDPOINTS`.
        url: full endpoint URL.
        model: ``model`` field sent.
        temperature: sampling temperature (0 is greedy).
        ignore_eos: send the ``ignore_eos`` extension (vLLM, pdserve) so outputs run to
            ``max_tokens``.
        api_key: bearer token, or None.
        timeout_s: per-request timeout.
        extra_body: fields merged into every request body (e.g. a ``response_format``).
    """

    backend: str
    url: str
    model: str
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0
    extra_body: dict | None = None


@dataclass
class RequestOutput:
    """What one request measured (times in seconds, on ``time.perf_counter``).

    Attributes:
        success: a 200 answer that streamed to its end.
        prompt_len: prompt tokens (server usage, else the dataset's count).
        output_len: generated tokens (server usage, else re-tokenized text); None until
            known.
        ttft_s: time to the first content chunk.
        itl_s: gaps between later content chunks.
        latency_s: request start to the end of the stream.
        start_s: when the request was sent.
        has_usage: whether the server reported usage.
    """

    success: bool = False
    prompt_len: int = 0
    output_len: int | None = None
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    start_s: float = 0.0
    generated_text: str = ""
    error: str = ""
    has_usage: bool = False


def build_payload(settings: RequestSettings, request: SampleRequest) -> dict:
    """The JSON body for ``request``."""
    body = {"model": settings.model, "max_tokens": request.expected_output_len,
            "temperature": settings.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if settings.ignore_eos:
        body["ignore_eos"] = True
    if settings.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if settings.extra_body:
        body.update(settings.extra_body)
    return body


def _chunk_text(chunk: dict, backend: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if backend == "openai-chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(client: httpx.AsyncClient, settings: RequestSettings,
                       request: SampleRequest) -> RequestOutput:
    """Send ``request`` streamed and time it; never raises for HTTP or stream errors
    (they come back as ``success=False`` with ``error``)."""
    out = RequestOutput(prompt_len=request.prompt_len)
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    out.start_s = last_s = time.perf_counter()
    text_parts: list[str] = []
    try:
        async with client.stream("POST", settings.url, json=build_payload(settings, request),
                                 headers=headers, timeout=settings.timeout_s) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])
                    return out
                now = time.perf_counter()
                text = _chunk_text(chunk, settings.backend)
                if text:
                    if not text_parts:
                        out.ttft_s = now - out.start_s
                    else:
                        out.itl_s.append(now - last_s)
                    last_s = now
                    text_parts.append(text)
                usage = chunk.get("usage")
                if usage:
                    out.has_usage = True
                    out.prompt_len = usage.get("prompt_tokens", out.prompt_len)
                    out.output_len = usage.get("completion_tokens")
        out.latency_s = time.perf_counter() - out.start_s
        out.generated_text = "".join(text_parts)
        out.success = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out
