"""Workloads built from real data: token-id prompts with the sharing structure of the papers.

One module per workload (docs/design.md section 10), the real data sets in ``sources`` (read
and tokenized once per process), shared helpers in ``base``, names and mixes in
``registry``. Use::

    build_workload("toolbench", 1000, seed=0, zipf=1.1, prefixes=100)
    build_mix("toolbench:0.5,videoqa:0.5", 1000, seed=0)

``docs/workloads.md`` describes each workload and its measured statistics.
"""

from prefixmesh.loadgen.workloads.base import (
    WorkloadOptions,
    WorkloadRequest,
    zipf_weights,
)
from prefixmesh.loadgen.workloads.registry import (
    WORKLOADS,
    WorkloadSpec,
    build_mix,
    build_workload,
    make_options,
    parse_mix,
)
from prefixmesh.loadgen.workloads.toolbench import TOOLBENCH_SYSTEM, toolbench_text

__all__ = [
    "TOOLBENCH_SYSTEM",
    "WORKLOADS",
    "WorkloadOptions",
    "WorkloadRequest",
    "WorkloadSpec",
    "build_mix",
    "build_workload",
    "make_options",
    "parse_mix",
    "toolbench_text",
    "zipf_weights",
]
