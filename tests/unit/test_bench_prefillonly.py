"""The PrefillOnly benchmark's scaled ``postrec`` (loadgen/bench_prefillonly.py): profiles cut
to fit SmolLM2's context, each user's cut the same, so requests of a user still share it."""

from __future__ import annotations

from collections import defaultdict

from prefixmesh.loadgen.bench_prefillonly import scaled_postrec
from prefixmesh.loadgen.workloads import build_workload
from prefixmesh.shared.models import SMOLLM2


def test_scaled_postrec_keeps_each_users_shared_prefix_and_fits_the_context() -> None:
    full = build_workload("postrec", 60, seed=3, prefixes=8)
    scaled = scaled_postrec(60, 3, users=8, scale=0.1)
    assert [p for p, _, _ in scaled] == [r.prefix_id for r in full]
    by_user: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for (user, ids, shared), r in zip(scaled, full, strict=True):
        by_user[user].add(tuple(ids[:shared]))
        # The request's own part (post and question) is untouched; the profile is a tenth.
        assert ids[shared:] == r.prompt[r.shared_tokens:]
        assert abs(shared - 0.1 * r.shared_tokens) < 60
        assert len(ids) + 1 <= SMOLLM2.context_length
    assert all(len(prefixes) == 1 for prefixes in by_user.values())
    assert len(by_user) == 8
