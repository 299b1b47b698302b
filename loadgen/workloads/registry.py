"""The workload registry: names -> builders and their typed options; mixes of workloads."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixmesh.loadgen.workloads import (
    batch,
    embodied,
    loogle,
    lowshare,
    multiturn,
    prefillonly,
    programming,
    sharegpt,
    toolbench,
    videoqa,
)
from prefixmesh.loadgen.workloads.base import (
    WorkloadOptions,
    WorkloadRequest,
    stable_seed,
)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """One registered workload."""

    name: str
    build: Callable[[int, int, Any], list[WorkloadRequest]]
    options: type[WorkloadOptions]
    summary: str


WORKLOADS: dict[str, WorkloadSpec] = {
    spec.name: spec for spec in (
        WorkloadSpec("toolbench", toolbench.build, WorkloadOptions,
                     "tool-use agent: system + Zipf-popular tool instructions + query"),
        WorkloadSpec("embodied", embodied.build, embodied.EmbodiedOptions,
                     "ALFWorld ReAct agent: each step extends the previous context"),
        WorkloadSpec("programming", programming.build, programming.ProgrammingOptions,
                     "few-shot code demos + problem, several parallel samples"),
        WorkloadSpec("videoqa", videoqa.build, WorkloadOptions,
                     "video tokens + NExT-QA questions, several per video"),
        WorkloadSpec("loogle", loogle.build, WorkloadOptions,
                     "long LooGLE document + question, many questions per document"),
        WorkloadSpec("sharegpt", sharegpt.build, WorkloadOptions,
                     "real ShareGPT prompts and response lengths, little sharing"),
        WorkloadSpec("multiturn", multiturn.build, multiturn.MultiturnOptions,
                     "real multi-turn ShareGPT chats: each turn's prompt is the history so far"),
        WorkloadSpec("lowshare", lowshare.build, WorkloadOptions,
                     "a quarter of each prompt shared (4 preambles), ShareGPT output lengths"),
        WorkloadSpec("postrec", prefillonly.build_postrec, WorkloadOptions,
                     "PrefillOnly post recommendation: 14k-token profile + post, 1 token out"),
        WorkloadSpec("creditver", prefillonly.build_creditver, WorkloadOptions,
                     "PrefillOnly credit verification: 40k-60k-token profile, 1 token out"),
        WorkloadSpec("batch", batch.build, batch.BatchOptions,
                     "BatchLLM offline batch: documents shared by groups of prompts"),
    )
}


def make_options(name: str, **options: Any) -> WorkloadOptions:
    """The typed options of workload ``name``; ``None`` values mean "the default"."""
    spec = _spec(name)
    given = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(given) - set(spec.options.names()))
    if unknown:
        raise ValueError(f"workload {name!r} has no option(s) {unknown}; "
                         f"it accepts {list(spec.options.names())}")
    opts = spec.options(**given)
    if opts.prefixes is not None and opts.prefixes < 1:
        raise ValueError("prefixes must be at least 1")
    return opts


def build_workload(name: str, count: int, seed: int = 0, **options: Any
                   ) -> list[WorkloadRequest]:
    """``count`` requests of workload ``name`` (or a mix "a:0.5,b:0.5"), reproducible by seed."""
    if "," in name or ":" in name:
        return build_mix(name, count, seed, **options)
    if count < 0:
        raise ValueError("count must be >= 0")
    opts = make_options(name, **options)
    if count == 0:
        return []
    return WORKLOADS[name].build(count, seed, opts)


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """``"toolbench:0.5,videoqa:0.5"`` -> [(name, weight)], weights normalized to sum 1.

    A part without a weight counts 1 ("toolbench,videoqa" is an even mix).
    """
    parts: list[tuple[str, float]] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, weight = part.partition(":")
        name = name.strip()
        _spec(name)
        try:
            w = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise ValueError(f"bad weight in mix part {part!r}") from None
        if w < 0:
            raise ValueError(f"negative weight in mix part {part!r}")
        parts.append((name, w))
    total = sum(w for _, w in parts)
    if not parts or total <= 0:
        raise ValueError(f"empty mix {spec!r}")
    return [(n, w / total) for n, w in parts]


def mix_counts(weights: list[tuple[str, float]], count: int) -> list[int]:
    """Requests per part: largest-remainder rounding of ``count * weight`` (sums to count)."""
    exact = [count * w for _, w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: count - sum(counts)]:
        counts[i] += 1
    return counts


def build_mix(spec: str, count: int, seed: int = 0, **options: Any) -> list[WorkloadRequest]:
    """A mix of workloads in the given proportions, interleaved in seeded random order.

    Each part is built with ``seed`` and the options its workload accepts; an option no
    part accepts is an error. Each part keeps its own request order (agent steps stay in
    sequence); the parts are merged by a seeded shuffle of their labels.
    """
    weights = parse_mix(spec)
    names = [n for n, _ in weights]
    given = {k: v for k, v in options.items() if v is not None}
    accepted = set().union(*(WORKLOADS[n].options.names() for n in names))
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise ValueError(f"no workload of mix {spec!r} has option(s) {unknown}")
    counts = mix_counts(weights, count)
    parts: list[list[WorkloadRequest]] = []
    labels: list[int] = []
    for i, (name, n) in enumerate(zip(names, counts)):
        own = {k: v for k, v in given.items() if k in WORKLOADS[name].options.names()}
        parts.append(build_workload(name, n, seed, **own))
        labels.extend([i] * n)
    random.Random(stable_seed("mix", spec, seed)).shuffle(labels)
    cursors = [0] * len(parts)
    out: list[WorkloadRequest] = []
    for i in labels:
        out.append(parts[i][cursors[i]])
        cursors[i] += 1
    return out


def _spec(name: str) -> WorkloadSpec:
    spec = WORKLOADS.get(name)
    if spec is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return spec
