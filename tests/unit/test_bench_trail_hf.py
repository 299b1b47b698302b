"""The real-model TRAIL benchmark's request set and its command line (no mesh started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixmesh.loadgen.bench_trail_hf import main, requests_for
from prefixmesh.loadgen.options import WorkloadSpec


def test_requests_keep_the_prompts_under_one_budget_and_stop_at_the_end_token() -> None:
    spec = WorkloadSpec("sharegpt", seed=3)
    plain = spec.requests(5)
    reqs = requests_for(spec, 5, 256)
    assert [r.prompt for r in reqs] == [r.prompt for r in plain]
    assert all(r.max_tokens == 256 and r.output_len == 0 for r in reqs)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    base = ["--artifact", str(tmp_path), "--rate", "0.1", "--json", str(tmp_path / "o.json")]
    with pytest.raises(SystemExit, match="unknown variants: lifo"):
        main([*base, "--variants", "fcfs,lifo"])
    with pytest.raises(SystemExit, match="--seeds"):
        main([*base, "--seeds", "0,x"])
    with pytest.raises(SystemExit, match="not a predictor artifact"):
        main(["--artifact", str(tmp_path / "none"), "--rate", "0.1", "--json", "o.json"])
