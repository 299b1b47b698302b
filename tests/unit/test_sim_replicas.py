"""Scheduler replicas: ``apply_remote_decision`` on every policy, and the simulator's
replicas with a sync delay (``prefixmesh sim --schedulers R --sync-delay-ms D``)."""

from __future__ import annotations

import json

import pytest

from prefixmesh.loadgen.cluster_sim import ClusterConfig, ClusterSim
from prefixmesh.loadgen.sim_replicas import (
    ReplicaConfig,
    ReplicatedPolicy,
    replica_label,
    replica_matrix,
    replica_report,
)
from prefixmesh.loadgen.sweep import main as sim_main
from prefixmesh.services.scheduler.policies import make_policy
from prefixmesh.services.scheduler.policies.base import Decision, PolicyConfig
from prefixmesh.services.scheduler.policies.e2 import E2Policy
from prefixmesh.services.scheduler.policies.e2_replicate import Replica
from prefixmesh.shared.blocks import BLOCK_SIZE
from prefixmesh.shared.wire import RequestDoneEvent
from tests.helpers import default_cost, e2_policy, route_input, shared_prefix_requests, toks

COST = default_cost()


def _pair(name: str, n: int = 4):
    """Two replicas of policy ``name`` over workers w0..w<n-1>."""
    out = []
    for _ in range(2):
        p = make_policy(name, PolicyConfig(), COST)
        for i in range(n):
            p.add_worker(f"w{i}", 0, 0.0)
        out.append(p)
    return out


def _done(rid: str, worker: str, tokens: int = 8) -> RequestDoneEvent:
    return RequestDoneEvent(request_id=rid, worker_id=worker, prompt_tokens=0,
                            completion_tokens=tokens, cached_tokens=0, queue_s=0.0,
                            ttft_s=0.1, latency_s=1.0, finish_reason="stop")


def _routed_and_learnt(prefix: list[int], tail: list[int], learnt_at: float = 0.0):
    """Two E2 replicas: ``a`` routes ``r0`` (prefix + tail), ``b`` learns that decision."""
    a, b = e2_policy(), e2_policy()
    first = route_input("r0", prefix, tail)
    d = a.route(first, 0.0)
    b.apply_remote_decision(first, d, learnt_at)
    return a, b, first, d


def test_e2_replica_learns_the_load_and_the_cache_of_a_remote_decision():
    prefix = toks(1, 100)
    a, b, first, d = _routed_and_learnt(prefix, toks(1000, 2), 0.001)
    assert b.worker_state(d.worker_id).L == pytest.approx(a.worker_state(d.worker_id).L)
    assert b.worker_state(d.worker_id).L > 0
    # Twice the same decision counts once.
    b.apply_remote_decision(first, d, 0.002)
    assert b.worker_state(d.worker_id).L == pytest.approx(a.worker_state(d.worker_id).L)
    # The predicted tree entry makes the next request with that prefix an exploit there.
    nxt = b.route(route_input("r1", prefix, toks(1001, 2)), 0.01)
    assert (nxt.worker_id, nxt.kind) == (d.worker_id, "exploit")
    assert nxt.matched_tokens == 100 * BLOCK_SIZE
    # A replica that never heard of r0 explores instead.
    c = e2_policy()
    assert c.route(route_input("r1", prefix, toks(1001, 2)), 0.01).kind == "explore"


def test_e2_completion_corrects_a_remote_decision_and_unknown_workers_are_ignored():
    a, b = e2_policy(), e2_policy()
    req = route_input("r0", toks(3, 40))
    d = a.route(req, 0.0)
    b.apply_remote_decision(req, d, 0.0)
    before = b.worker_state(d.worker_id).L
    b.on_done(_done("r0", d.worker_id, tokens=2000), 1.0)
    assert b.worker_state(d.worker_id).L > before
    b.remove_worker(d.worker_id, 1.0)
    b.apply_remote_decision(route_input("r1", toks(4, 40)), d, 1.1)  # no error, no effect
    assert d.worker_id not in b.workers


def test_e2_remote_request_seeds_a_pending_hot_prefix_replica():
    prefix = toks(20, 100)
    _, b, first, d = _routed_and_learnt(prefix, toks(21, 2))
    node, _ = b.tree.match(first.block_hashes)
    target = next(w for w in b.workers if w != d.worker_id)
    rep = Replica(0.0, 1)
    rep.pending.append(target)
    b.replicator.entries[node] = rep
    seed = route_input("r1", prefix, toks(22, 2))
    b.apply_remote_decision(seed, Decision(target, "replicate", 100 * BLOCK_SIZE), 0.1)
    assert rep.pending == []  # b will not send its own first request there


def test_least_load_replica_counts_remote_requests_as_outstanding():
    a, b = _pair("least_load", n=2)
    req = route_input("r0", toks(5, 4))
    d = a.route(req, 0.0)
    b.apply_remote_decision(req, d, 0.0)
    # b sees the worker a just loaded: its own next request goes to the other one.
    assert b.route(route_input("r1", toks(6, 4)), 0.0).worker_id != d.worker_id
    b.on_done(_done("r0", d.worker_id), 1.0)
    assert b.out.count[d.worker_id] == 0


@pytest.mark.parametrize("name", ["cache_aware", "weighted"])
def test_decision_learning_baselines_record_the_remote_prompt(name):
    a, b = _pair(name)
    prefix = toks(7, 60)
    req = route_input("r0", prefix, toks(8, 2))
    d = a.route(req, 0.0)
    b.apply_remote_decision(req, d, 0.0)
    got = b.route(route_input("r1", prefix, toks(9, 2)), 0.1)
    assert got.worker_id == d.worker_id and got.matched_tokens >= 60 * BLOCK_SIZE


def test_kv_cost_takes_its_cache_from_events_not_from_remote_decisions():
    a, b = _pair("kv_cost")
    req = route_input("r0", toks(10, 60))
    d = a.route(req, 0.0)
    b.apply_remote_decision(req, d, 0.0)
    assert b.tree.match(req.block_hashes)[1] == 0
    assert b.out.blocks[d.worker_id] > 0  # but its active blocks count


# --------------------------------------------------------------------------- simulator


def _latencies(cfg: ClusterConfig) -> list[float]:
    reqs = shared_prefix_requests(40)
    return [r.latency_s for r in ClusterSim(cfg).run(reqs, [i * 0.05 for i in range(40)]).results]


def test_one_replica_without_delay_is_the_bare_policy_and_instant_replicas_match_it():
    bare = _latencies(ClusterConfig(policy="e2"))
    assert isinstance(ClusterSim(ClusterConfig(policy="e2")).policy, E2Policy)
    four = ClusterConfig(policy="e2", replicas=ReplicaConfig(schedulers=4))
    assert isinstance(ClusterSim(four).policy, ReplicatedPolicy)
    assert _latencies(four) == bare


def test_a_replica_sees_another_replicas_decision_only_after_the_sync_delay():
    rp = ReplicatedPolicy("e2", PolicyConfig(), COST,
                          ReplicaConfig(schedulers=2, sync_delay_s=0.01))
    for i in range(4):
        rp.add_worker(f"w{i}", 0, 0.0)
    other = rp.replicas[1]
    assert isinstance(other, E2Policy)
    rp.route(route_input("r0", toks(11, 40)), 0.0)  # replica 0's turn
    rp.tick(0.009)
    assert "r0" not in other.window.by_rid
    rp.tick(0.01)
    assert "r0" in other.window.by_rid
    assert rp.routed == [1, 0] and rp.remote_applied == 1


def test_without_shared_decisions_replicas_never_learn_each_others_load():
    rp = ReplicatedPolicy("e2", PolicyConfig(), COST,
                          ReplicaConfig(schedulers=2, share_decisions=False))
    for i in range(4):
        rp.add_worker(f"w{i}", 0, 0.0)
    rp.route(route_input("r0", toks(12, 40)), 0.0)
    rp.tick(1.0)
    other = rp.replicas[1]
    assert isinstance(other, E2Policy)
    assert "r0" not in other.window.by_rid and rp.remote_applied == 0


def test_replica_config_rejects_bad_values():
    with pytest.raises(ValueError):
        ReplicaConfig(schedulers=0)
    with pytest.raises(ValueError):
        ReplicaConfig(sync_delay_s=-1)
    with pytest.raises(ValueError):
        ReplicaConfig(split="hash")


def test_sim_verb_runs_every_replica_point_and_the_report_compares_them(tmp_path):
    out = tmp_path / "rep.json"
    assert sim_main(["--gpus", "2", "--workload", "toolbench", "--rates", "4",
                     "--policies", "e2", "--duration", "5", "--schedulers", "1,2",
                     "--sync-delay-ms", "0,10",
                     "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["e2", "e2@1x10ms", "e2@2x0ms", "e2@2x10ms"]
    assert [(r["schedulers"], r["sync_delay_ms"]) for r in runs] == [
        (1, 0), (1, 10), (2, 0), (2, 10)]
    assert sum(runs[3]["replica_routed"]) == runs[3]["requests"]
    table = replica_report(runs)
    assert "| 2 | 10 | yes | 0 |" in table and "+0.0% | +0.0% |" in table
    matrix = replica_matrix(runs)
    assert "| schedulers | 0 ms | 10 ms |" in matrix
    assert "| 1 | +0.0% / +0.0% |" in matrix and matrix.count("\n| 2 | ") == 1


def test_prefix_split_sends_a_prefix_to_one_replica_and_labels_name_the_split():
    rp = ReplicatedPolicy("e2", PolicyConfig(), COST,
                          ReplicaConfig(schedulers=4, sync_delay_s=0.05, split="prefix"))
    for i in range(4):
        rp.add_worker(f"w{i}", 0, 0.0)
    prefix = toks(30, 40)
    for i in range(6):
        rp.route(route_input(f"r{i}", prefix, toks(100 + i, 2)), 0.001 * i)
    assert sorted(rp.routed) == [0, 0, 0, 6]
    assert replica_label("e2", ReplicaConfig(2, 0.01, "random")) == "e2@2x10ms-random"
    assert replica_label("e2", ReplicaConfig(2, 0.01, "prefix", share_decisions=False)) == (
        "e2@2x10ms-nodec-prefix")
