"""``prefixmesh bench-router``: which runs a contender list expands to."""

from __future__ import annotations

from pathlib import Path

from prefixmesh.loadgen.bench_router import runs_of
from prefixmesh.loadgen.compare import Contender


def test_each_prefixmesh_contender_runs_once_per_edge_count_and_code(tmp_path: Path) -> None:
    names = ["prefixmesh-e2", "sglang-cache_aware", "direct"]
    contenders = {n: Contender.parse(n) for n in names if n != "direct"}
    runs = runs_of(names, contenders, [1, 2], tmp_path)
    assert list(runs) == ["prefixmesh-e2", "prefixmesh-e2 (2 edges)",
                          "prefixmesh-e2 (baseline)", "prefixmesh-e2 (2 edges) (baseline)",
                          "sglang-cache_aware"]
    assert [r[2] for r in runs.values()] == [1, 2, 1, 2, 1]
    # The baseline's runs put its code first on the services' path; the others run this.
    assert runs["prefixmesh-e2 (baseline)"][1] == {"PYTHONPATH": str(tmp_path.resolve())}
    assert runs["prefixmesh-e2 (2 edges)"][1] == {}
    # An HTTP router has one process whatever --edges says; direct is no run of its own.
    assert runs_of(names, contenders, [4], None) == {
        "prefixmesh-e2 (4 edges)": (contenders["prefixmesh-e2"], {}, 4),
        "sglang-cache_aware": (contenders["sglang-cache_aware"], {}, 1)}
