"""The trained TRAIL predictor's outputs in the cluster simulator (``prefixmesh sim
--predictions initial|refined --predictions-file PATH``).

``prefixmesh predictor eval --preds PATH`` writes, for every held-out ShareGPT conversation,
what the predictor said about it: the head's initial prediction (expected output tokens,
from the prompt alone) and, at every ``stride``-th decode step ``t``, the refined
prediction of the remaining tokens (probe over SmolLM2's teacher-forced hidden state of
that very reply, smoothed by the Bayesian update). Nothing here looks at the real length.

- ``initial`` mode: each request carries the head's prediction as ``predicted_output``.
- ``refined`` mode: the same, and once a request has generated token ``t`` (so the hidden
  state of step ``t`` exists), the reading of step ``t`` is passed to its engine's
  ``update_prediction`` as ``t + remaining_t - generated`` tokens left.

The workload is the ``sharegpt`` workload restricted to those conversations (each built
exactly as that workload builds it), in a seeded order. When the predictor was trained on
SmolLM2's own replies (``predictor train --replies model``), the file says so with the
replies' token ``budget``, and each request generates as many tokens as SmolLM2's reply to
it had (at most the budget, which becomes its ``max_tokens``): the lengths the predictions
are about, not ShareGPT's. When a run needs more requests than there are conversations
they are reused, each reuse under its own tenant so its prompt is not served from the
prefix cache a previous use left behind.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from prefixmesh.loadgen.workloads import WorkloadRequest
from prefixmesh.services.worker.engine.types import EngineRequest

PREDICTION_MODES = ("none", "oracle", "initial", "refined")
TRAIL_MODES = ("initial", "refined")


@dataclass(frozen=True, slots=True)
class RequestPredictions:
    """What the predictor said about one conversation."""

    initial: float  # head's expected output tokens
    steps: tuple[int, ...]  # decode steps of the probe readings, ascending
    remaining: tuple[float, ...]  # refined remaining tokens at each of ``steps``
    length: int = 0  # the reply's real length (output tokens), used only with a budget


@dataclass(frozen=True, slots=True)
class TrailPredictions:
    """Predictions by the workload's ``prefix_id`` (``conv{i}``)."""

    requests: dict[str, RequestPredictions]
    # Token budget of generated replies (``--replies model``): requests then generate the
    # predicted replies' own lengths under it. None: ShareGPT's replies, the workload's.
    budget: int | None = field(default=None)

    @classmethod
    def load(cls, path: Path) -> TrailPredictions:
        """Read a file written by ``prefixmesh predictor eval --preds``."""
        raw = json.loads(Path(path).read_text())
        return cls({k: RequestPredictions(float(v["initial"]), tuple(v["steps"]),
                                          tuple(float(x) for x in v["remaining"]),
                                          int(v.get("length", 0)))
                    for k, v in raw["requests"].items()}, raw.get("budget"))

    def conversations(self) -> list[int]:
        """Conversation indices, ascending."""
        return sorted(int(k.removeprefix("conv")) for k in self.requests)


def trail_requests(preds: TrailPredictions, count: int, seed: int, tenant: str = ""
                   ) -> list[WorkloadRequest]:
    """``count`` sharegpt requests over the predicted conversations (module doc)."""
    from prefixmesh.loadgen.workloads.sharegpt import conversation_requests

    convs = preds.conversations()
    built = [r for r in conversation_requests(convs, tenant) if r is not None]
    if not built:
        raise ValueError("no predicted conversation passes the sharegpt length filter")
    if preds.budget is not None:  # SmolLM2's own replies: their lengths, under the budget
        built = [dataclasses.replace(r, max_tokens=preds.budget, output_len=min(
            preds.requests[r.prefix_id].length, preds.budget)) for r in built]
    random.Random(seed).shuffle(built)
    out = []
    for k in range(count):
        r = built[k % len(built)]
        reuse = k // len(built)
        out.append(r if reuse == 0 else WorkloadRequest(
            prompt=r.prompt, max_tokens=r.max_tokens, prefix_id=r.prefix_id,
            output_len=r.output_len, tenant=f"{tenant}~reuse{reuse}",
            shared_tokens=r.shared_tokens))
    return out


class _Engine(Protocol):
    def update_prediction(self, request_id: str, remaining_tokens: float) -> bool: ...


class Refiner:
    """Feeds each running request's probe readings to its engine as it generates."""

    def __init__(self) -> None:
        # request id -> (its predictions, index of the next reading not yet passed on)
        self._live: dict[str, tuple[RequestPredictions, int]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def attach(self, request_id: str, preds: RequestPredictions) -> None:
        """Follow ``request_id`` from now on."""
        self._live[request_id] = (preds, 0)

    def after_step(self, engine: _Engine, stepped: list[EngineRequest]) -> int:
        """Pass on the latest reading each request of a finished step has reached; forget
        finished requests. Returns how many updates were passed on."""
        sent = 0
        for req in stepped:
            entry = self._live.get(req.request_id)
            if entry is None:
                continue
            if req.finish_time is not None:
                del self._live[req.request_id]
                continue
            p, nxt = entry
            k = req.num_output_tokens
            j = nxt
            while j < len(p.steps) and p.steps[j] < k:  # reading t exists once token t does
                j += 1
            if j > nxt:
                t, rem = p.steps[j - 1], p.remaining[j - 1]
                engine.update_prediction(req.request_id, max(t + rem - k, 0.0))
                self._live[req.request_id] = (p, j)
                sent += 1
        return sent
