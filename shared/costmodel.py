"""GPU step-time cost model from per-profile fits (Preble's measurements, docs/design.md section 9).

A profile is a JSON file in ``shared/profiles``. Two shapes exist:

- ``batched`` (Mistral-7B profiles): one step costs ``linear(n) + attention(ctx)`` plus a
  long-prompt term per request with ``e * s > threshold``, all divided by ``efficiency``;
  ``n`` = tokens batched in the step, ``ctx`` = total context attended.
- ``per_request`` (Llama-3-70B profiles): ``const + sum(e*ke + s*ks + e*s*kes)``.

Everything returned is in **seconds**; fits are in milliseconds.

Correction to the published A6000 fit: its middle piece ``-118 + 1.25n - 2.56e-3 n^2``
peaks at n = 244 (34.6 ms) and turns negative before n = 384. We hold it at its peak
(``cap_n``) and never below the small-batch floor, so step time is non-decreasing in n.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PROFILE_DIR = Path(__file__).with_name("profiles")
DEFAULT_PROFILE = "mistral-7b-a6000"
MS = 1e-3


@dataclass(frozen=True, slots=True)
class _Segment:
    min_n: int
    coef: tuple[float, ...]
    cap_n: float

    def value(self, n: float) -> float:
        x = n if n < self.cap_n else self.cap_n
        acc = 0.0
        for c in reversed(self.coef):  # Horner: cheapest in the simulator's hot loop
            acc = acc * x + c
        return acc


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step time of a simulated GPU for one profile."""

    name: str
    kv_capacity_tokens: int
    block_size: int
    max_batched_tokens: int
    max_num_seqs: int
    efficiency: float
    linear: tuple[_Segment, ...] = ()
    attention: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    quadratic: tuple[float, float, float, float] | None = None
    per_request: tuple[float, float, float, float] | None = None
    # The model whose GPU time the profile describes, and its context length (tokens): what
    # a simulated worker on this profile imitates (shared/models.py).
    model: str = ""
    context_length: int = 0

    # ------------------------------------------------------------------ loading

    @staticmethod
    def from_dict(d: dict) -> CostModel:
        linear = tuple(
            sorted(
                (
                    _Segment(int(s["min_n"]), tuple(s["coef"]), float(s.get("cap_n", math.inf)))
                    for s in d.get("linear", [])
                ),
                key=lambda s: -s.min_n,
            )
        )
        att = d.get("attention")
        quad = d.get("quadratic")
        per = d.get("per_request")
        return CostModel(
            name=d["name"],
            kv_capacity_tokens=int(d["kv_capacity_tokens"]),
            block_size=int(d.get("block_size", 16)),
            max_batched_tokens=int(d.get("max_batched_tokens", 2048)),
            max_num_seqs=int(d.get("max_num_seqs", 256)),
            efficiency=float(d.get("efficiency", 1.0)),
            linear=linear,
            attention=(
                (att["threshold_ctx"], att["intercept"], att["slope"], att["below"])
                if att
                else (0.0, 0.0, 0.0, 0.0)
            ),
            quadratic=(quad["threshold_es"], quad["e"], quad["s"], quad["es"]) if quad else None,
            per_request=(per["const"], per["e"], per["s"], per["es"]) if per else None,
            model=d.get("model", ""),
            context_length=int(d.get("context_length", 0)),
        )

    @staticmethod
    def load(name_or_path: str) -> CostModel:
        """Load a profile by name (``shared/profiles/<name>.json``) or by file path."""
        return _load_cached(name_or_path)

    # ------------------------------------------------------------------ step time

    def _linear_ms(self, n: float) -> float:
        floor = self.linear[-1].value(n) if self.linear else 0.0
        for seg in self.linear:
            if n >= seg.min_n:
                return max(seg.value(n), floor)
        return floor

    @property
    def quadratic_threshold(self) -> float:
        """``e * s`` above which a request adds the long-prompt term (inf: no such term)."""
        return self.quadratic[0] if self.quadratic is not None else float("inf")

    def _attention_ms(self, ctx: float) -> float:
        threshold, intercept, slope, below = self.attention
        return slope * ctx + intercept if ctx > threshold else below

    def step_time(self, batch: Iterable[tuple[int, int]], decodes: int = 0,
                  decode_ctx: int = 0) -> float:
        """Seconds for one engine step running ``(extend_tokens, seq_len_after)`` pairs,
        plus ``decodes`` one-token entries given in aggregate (their sequence lengths sum
        to ``decode_ctx``; each must be at most ``quadratic_threshold``), so that a large
        decode batch costs O(1) here."""
        if self.per_request is not None:
            const, ke, ks, kes = self.per_request
            # e = 1 for a decode, so its e * s term is s.
            total = decodes * ke + decode_ctx * (ks + kes)
            seen = decodes > 0
            for e, s in batch:
                seen = True
                total += e * ke + s * ks + e * s * kes
            return ((const + total) / self.efficiency) * MS if seen else 0.0
        n, ctx = decodes, decode_ctx
        quad_ms = 0.0
        q = self.quadratic
        if q is None:
            for e, s in batch:
                n += e
                ctx += s
        else:
            threshold, qe, qs, qes = q
            for e, s in batch:
                n += e
                ctx += s
                if e * s > threshold:
                    quad_ms += qe * e + qs * s + qes * e * s
        if n == 0:
            return 0.0
        return (self._linear_ms(n) + self._attention_ms(ctx) + quad_ms) / self.efficiency * MS

    # ------------------------------------------------------------------ estimates for schedulers

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """PT: seconds to prefill ``new_tokens`` alone after ``cached_tokens``, chunked as the
        sim engine does (``max_batched_tokens`` per step)."""
        if new_tokens <= 0:
            return 0.0
        total = 0.0
        done = cached_tokens
        remaining = new_tokens
        while remaining > 0:
            chunk = min(remaining, self.max_batched_tokens)
            done += chunk
            remaining -= chunk
            total += self.step_time(((chunk, done),))
        return total

    def decode_time(self, context_tokens: int = 0) -> float:
        """Seconds of one decode step of a lone sequence with ``context_tokens`` context."""
        return self.step_time(((1, context_tokens + 1),))

    def marginal_decode_time(self, context_tokens: int, batch_size: int = 32) -> float:
        """DT: extra seconds one more sequence adds to a continuously batched decode step
        (the GPU work of one output token when the batch is already running)."""
        base = [(1, context_tokens + 1)] * batch_size
        return max(self.step_time(base + [(1, context_tokens + 1)]) - self.step_time(base), 0.0)

    @property
    def capacity_blocks(self) -> int:
        """KV cache size in blocks."""
        return self.kv_capacity_tokens // self.block_size


@cache
def _load_cached(name_or_path: str) -> CostModel:
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = ", ".join(available_profiles())
        raise ValueError(f"unknown cost-model profile {name_or_path!r} (known: {known})")
    return CostModel.from_dict(json.loads(path.read_text()))


def available_profiles() -> list[str]:
    """Names of the profiles shipped in ``shared/profiles``."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def parse_gpu_profiles(text: str) -> tuple[str, ...]:
    """``PROFILE:COUNT,...`` (``mistral-7b-a100:2,mistral-7b-a6000:2``) as one profile name
    per worker, in order; a bare ``PROFILE`` counts 1. Raises ValueError on an unknown
    profile or a count below 1."""
    out: list[str] = []
    for part in text.split(","):
        name, _, count = part.strip().partition(":")
        if not name:
            continue
        if name not in available_profiles():
            known = ", ".join(available_profiles())
            raise ValueError(f"unknown cost-model profile {name!r} (known: {known})")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ValueError(f"bad GPU count in {part.strip()!r}") from None
        if n < 1:
            raise ValueError(f"GPU count must be at least 1 in {part.strip()!r}")
        out.extend([name] * n)
    if not out:
        raise ValueError("no GPU profiles given")
    return tuple(out)


def profile_counts(profiles: Iterable[str]) -> str:
    """The ``PROFILE:COUNT,...`` text of per-worker profiles (runs of one profile merged)."""
    runs: list[list] = []
    for p in profiles:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return ",".join(f"{p}:{n}" for p, n in runs)
