"""Measure prefix reuse on a live mesh: two chat requests sharing a long system prompt.

``python -m prefixmesh.loadgen.bench_engine_hf --url http://127.0.0.1:8000`` (a mesh started
with ``prefixmesh up --backend hf``) sends request A, then request B with the same system
prompt and another question, streaming both, and prints per request the client-side TTFT,
the cached prompt tokens the edge reports (``usage.prompt_tokens_details.cached_tokens``)
and the text. A benchmark, not a test: run it on purpose.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

# A long shared prompt (~1,000 SmolLM2 tokens), then distinct questions.
SYSTEM = ("You are the archivist of a harbour town. The harbour log records every ship that "
          "entered or left: its name, flag, cargo, tonnage, crew size, the pilot who guided it "
          "and the weather at the time. ") * 22
QUESTIONS = ("What does the harbour log record?", "Who guides ships into the harbour?")


def stream_chat(url: str, question: str, max_tokens: int) -> dict:
    """One streamed chat completion; client-side TTFT and the usage the edge reports."""
    body = json.dumps({
        "model": "smollm2-135m-instruct", "stream": True, "max_tokens": max_tokens,
        "temperature": 0.0, "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(delta)
            usage = chunk.get("usage") or usage
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"question": question, "ttft_s": round(ttft or 0.0, 3),
            "latency_s": round(time.perf_counter() - t0, 3),
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "cached_tokens": cached,
            "text": "".join(text)}


def main() -> None:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="edge URL")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    runs = [stream_chat(args.url, q, args.max_tokens) for q in QUESTIONS]
    print(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
