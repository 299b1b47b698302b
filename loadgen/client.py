"""Open-loop HTTP client for any OpenAI-compatible ``/v1/completions`` endpoint.

Requests are sent at their arrival times whether or not earlier ones finished (open loop),
streamed so the first token's time is measured, with ``stream_options.include_usage`` for
prompt and cached token counts. Failures are counted, never raised.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence

import aiohttp

from prefixmesh.loadgen.results import RequestResult
from prefixmesh.loadgen.workloads import WorkloadRequest

DEFAULT_TIMEOUT_S = 600.0


async def send_one(session: aiohttp.ClientSession, url: str, model: str,
                   req: WorkloadRequest, ignore_eos: bool = True) -> RequestResult:
    """Send one streaming completion; measure latency and TTFT from the client side."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos, "temperature": 0.0}
    start = time.perf_counter()
    ttft = 0.0
    out = RequestResult(ok=False)
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = await resp.text()
                out.error = f"HTTP {resp.status}: {text[:200]}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = event["error"].get("message", "stream error")
                    return out
                if event.get("choices") and ttft == 0.0 and event["choices"][0].get("text"):
                    ttft = time.perf_counter() - start
                usage = event.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens", 0)
                    out.output_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens") or 0
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.latency_s = time.perf_counter() - start
    out.ttft_s = ttft or out.latency_s
    out.ok = True
    return out


async def run_open_loop(url: str, model: str, requests: Sequence[WorkloadRequest],
                        arrivals: Sequence[float], timeout_s: float = DEFAULT_TIMEOUT_S,
                        on_done: Callable[[RequestResult], None] | None = None,
                        ignore_eos: bool = True) -> tuple[list[RequestResult], float]:
    """Replay ``requests`` at ``arrivals`` (seconds); returns results and the wall duration.
    ``ignore_eos``: every request generates its ``max_tokens`` (False: until the model's end
    token, at most ``max_tokens``)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()

        async def fire(req: WorkloadRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            # How late the send is: a client that cannot keep up offers less than its rate.
            lag = max(time.perf_counter() - start - at, 0.0)
            res = await send_one(session, url, model, req, ignore_eos)
            res.send_lag_s = lag
            if on_done is not None:
                on_done(res)
            return res

        results = await asyncio.gather(*(fire(r, t) for r, t in zip(requests, arrivals)))
        return list(results), time.perf_counter() - start
