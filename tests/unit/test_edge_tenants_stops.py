"""Pure edge logic: stop sequences, API keys and admission, sim pseudo-logprobs."""

from __future__ import annotations

import math

import pytest

from prefixmesh.services.edge.stops import StopMatcher
from prefixmesh.services.edge.tenants import (
    Admission,
    ApiKeys,
    TenantLimits,
    TokenBucket,
    bearer_key,
)
from prefixmesh.services.worker.engine.sim_logprobs import (
    candidate_logprobs,
    scored_token,
    token_logprobs,
)
from prefixmesh.shared.openai.schema import ApiError


def _stream(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = "".join(m.feed(c) for c in chunks)
    return out + m.flush(), m.stopped


def test_stop_across_chunk_boundaries() -> None:
    assert _stream(["END"], ["hello E", "N", "D tail"]) == ("hello ", True)
    assert _stream(["END"], ["hello E", "NX"]) == ("hello ENX", False)
    assert _stream(["b", "abc"], ["xxab"]) == ("xxa", True)  # earliest match wins
    assert _stream([], ["a", "b"]) == ("ab", False)


def test_api_keys_file_and_limits(tmp_path) -> None:
    f = tmp_path / "keys.toml"
    f.write_text('[tenants.a]\nkeys = ["k1", "k2"]\nrate_rps = 2\nburst = 3\n'
                 '[tenants.b]\nkeys = ["k3"]\n')
    keys = ApiKeys.load(f)
    assert keys.keys == {"k1": "a", "k2": "a", "k3": "b"}
    assert keys.limits_of("a") == TenantLimits(2.0, 3, TenantLimits().max_inflight)
    f.write_text('[tenants.a]\nkeys = ["k"]\n[tenants.b]\nkeys = ["k"]\n')
    with pytest.raises(ValueError):
        ApiKeys.load(f)
    assert bearer_key("Bearer  sk-1 ") == "sk-1" and bearer_key("Basic x") == ""


def test_token_bucket_refills() -> None:
    b = TokenBucket(rate=2.0, burst=2, now=0.0)
    assert b.take(0.0) == 0 and b.take(0.0) == 0
    assert b.take(0.0) == pytest.approx(0.5)
    assert b.take(0.5) == 0


def test_admission_tenant_share_rate_and_global_bound() -> None:
    keys = ApiKeys(limits={"a": TenantLimits(rate_rps=0, burst=1, max_inflight=2)})
    adm = Admission(keys, max_inflight=3)
    adm.enter("a", 0.0)
    adm.enter("a", 0.0)
    with pytest.raises(ApiError) as e:
        adm.enter("a", 0.0)
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
    adm.enter("b", 0.0)
    with pytest.raises(ApiError) as e:
        adm.enter("c", 0.0)
    assert e.value.status == 503 and "Retry-After" in e.value.headers
    adm.leave("a")
    adm.enter("c", 0.0)
    assert adm.inflight == 3


def test_sim_logprobs_are_deterministic_and_normalised() -> None:
    text = str
    a = token_logprobs("k", 3, 1001, range(1000, 1010), 3, text)
    assert a == token_logprobs("k", 3, 1001, range(1000, 1010), 3, text)
    assert a.logprob < 0 and a.top[0].token_id == 1001 and len(a.top) == 3
    assert [t.logprob for t in a.top] == sorted((t.logprob for t in a.top), reverse=True)
    lps = candidate_logprobs([1, 2, 3], [10, 20, 30])
    assert math.isclose(sum(math.exp(x) for x in lps), 1.0)
    best = scored_token([1, 2, 3], [10, 20, 30], 5, text)
    assert best.logprob == max(lps) and len(best.top) == 3


def test_auth_off_only_the_edge_wide_bound_applies() -> None:
    # Every request is the anonymous tenant's; the per-tenant defaults (256 in flight,
    # 50 req/s) would cap a benchmark, not share the edge between tenants.
    adm = Admission(ApiKeys(), max_inflight=400)
    for _ in range(400):
        adm.enter("", 0.0)
    with pytest.raises(ApiError) as e:
        adm.enter("", 0.0)
    assert e.value.status == 503
    adm.leave("")
    adm.enter("", 0.0)
    # A named tenant without written limits still gets the defaults.
    other = Admission(ApiKeys(), max_inflight=10_000)
    for _ in range(TenantLimits().burst):
        other.enter("t", 0.0)
    with pytest.raises(ApiError) as e:
        other.enter("t", 0.0)
    assert e.value.status == 429
