"""Placement in uneven fleets and under cache pressure: per-worker cost profiles (E2 prices
each GPU by its own profile), mixed fleets in the simulator, the multi-turn workload and
the cache-pressure sizing."""

from __future__ import annotations

import pytest

from prefixmesh.loadgen.cluster_sim import (
    ClusterConfig,
    ClusterSim,
    pressure_blocks,
    working_set_blocks,
)
from prefixmesh.loadgen.workloads import WorkloadRequest, build_workload
from prefixmesh.services.worker.engine.types import SimEngineConfig
from prefixmesh.shared.costmodel import CostModel, parse_gpu_profiles, profile_counts
from prefixmesh.shared.wire import LoadReportEvent
from tests.helpers import e2_policy, route_input, toks


def test_gpu_profiles_parse_to_one_profile_per_worker():
    got = parse_gpu_profiles("mistral-7b-a100:2, mistral-7b-a6000")
    assert got == ("mistral-7b-a100", "mistral-7b-a100", "mistral-7b-a6000")
    assert profile_counts(got) == "mistral-7b-a100:2,mistral-7b-a6000:1"
    for bad in ("nosuch-gpu:2", "mistral-7b-a100:0", "mistral-7b-a100:x", ""):
        with pytest.raises(ValueError):
            parse_gpu_profiles(bad)


def test_h100_profile_is_faster_than_a100_and_a6000():
    a6000, a100, h100 = (CostModel.load(f"mistral-7b-{g}") for g in ("a6000", "a100", "h100"))
    for n in (1, 512, 2048, 8192):
        assert h100.prefill_time(n) < a100.prefill_time(n) < a6000.prefill_time(n)
    assert h100.decode_time(1000) < a100.decode_time(1000)


def _report(worker: str, profile: str) -> LoadReportEvent:
    return LoadReportEvent(worker_id=worker, ts=0.0, profile=profile)


def test_e2_prices_each_worker_by_the_profile_it_reports():
    p = e2_policy(2)  # default profile: the A6000
    p.on_load(_report("w1", "mistral-7b-h100"), 0.0)
    terms = p.explain(route_input("r", toks(1, 200)), 0.0)
    assert terms["w1"][2] < terms["w0"][2] / 3  # P: the same prefill, a third of the time
    # Cold prompts of equal size: the fast GPU takes more of them before costs level.
    got = [p.route(route_input(f"r{i}", toks(10 + i, 200)), 0.0).worker_id for i in range(8)]
    assert got.count("w1") > got.count("w0")
    # Back to no profile: the default tables again.
    p.on_load(_report("w1", ""), 0.0)
    assert p.worker_state("w1").tables is None


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_e2_step_term_prices_an_idle_worker_at_its_gpus_lone_decode_step(weight):
    from prefixmesh.services.scheduler.policies.base import PolicyConfig

    p = e2_policy(2, PolicyConfig(decode_step_weight=weight, gpu_step_weight=0.0))
    # Both idle (no step in the window): the A6000 still decodes each token 4x slower.
    p.on_load(_report("w0", "mistral-7b-a6000"), 0.0)
    p.on_load(LoadReportEvent(worker_id="w1", ts=0.0, profile="mistral-7b-h100",
                              avg_step_s=0.002), 0.0)
    a6000, h100 = (CostModel.load(f"mistral-7b-{g}") for g in ("a6000", "h100"))
    assert p.worker_state("w0").step_s == pytest.approx(weight * a6000.decode_time(0))
    assert p.worker_state("w1").step_s == pytest.approx(weight * h100.decode_time(0))
    # A long reply costs its decode steps on the GPU it would run on.
    req = route_input("r", toks(1, 200), max_tokens=500)
    costs = p.costs(req, 0.0)
    gap = costs["w0"] - costs["w1"]
    p_gap = p.explain(req, 0.0)["w0"][2] - p.explain(req, 0.0)["w1"][2]
    if weight:  # at least one token's worth of the two GPUs' step difference more
        assert gap > p_gap + weight * (a6000.decode_time(0) - h100.decode_time(0))
    else:
        assert gap == pytest.approx(p_gap)


def test_e2_gpu_step_term_is_the_gpus_own_decode_speed_not_its_report():
    from prefixmesh.services.scheduler.policies.base import PolicyConfig

    p = e2_policy(2, PolicyConfig(gpu_step_weight=0.5))
    a6000, h100 = (CostModel.load(f"mistral-7b-{g}") for g in ("a6000", "h100"))
    # Before any report, a worker is priced as the policy's own GPU (the A6000).
    assert p.worker_state("w0").step_s == pytest.approx(0.5 * a6000.decode_time(0))
    for step in (0.0, 0.2):  # whatever step the worker reports
        p.on_load(LoadReportEvent(worker_id="w1", ts=0.0, profile="mistral-7b-h100",
                                  avg_step_s=step), 0.0)
        assert p.worker_state("w1").step_s == pytest.approx(0.5 * h100.decode_time(0))
    req = route_input("r", toks(1, 200), max_tokens=400)
    costs, terms = p.costs(req, 0.0), p.explain(req, 0.0)
    assert (costs["w0"] - costs["w1"] > terms["w0"][2] - terms["w1"][2]
            + 0.5 * (a6000.decode_time(0) - h100.decode_time(0)))


def test_e2_keeps_its_own_profile_for_an_unknown_one():
    p = e2_policy(1)
    p.on_load(_report("w0", "no-such-gpu"), 0.0)
    assert p.worker_state("w0").tables is None


def test_simulator_runs_a_mixed_fleet_on_each_workers_profile():
    profiles = parse_gpu_profiles("mistral-7b-h100:1,mistral-7b-a6000:2")
    sim = ClusterSim(ClusterConfig(gpus=1, gpu_profiles=profiles))
    assert sim.cfg.gpus == 3
    assert [e.cost_model.name for e in sim.engines.values()] == list(profiles)
    reqs = [WorkloadRequest(prompt=toks(i, 64), max_tokens=4, prefix_id=f"p{i}", output_len=4)
            for i in range(12)]
    run = sim.run(reqs, [0.0] * len(reqs))
    assert all(r.ok for r in run.results)
    assert run.worker_requests["gpu0"] > run.worker_requests["gpu1"]


def test_multiturn_turns_extend_the_conversation_so_far():
    reqs = build_workload("multiturn", 200, seed=1)
    assert len(reqs) == 200
    last: dict[str, list[int]] = {}
    turns = 0
    for r in reqs:
        assert isinstance(r.prompt, list)
        prev = last.get(r.session)
        if prev is not None:
            turns += 1
            # Turn k's prompt starts with turn k-1's whole prompt (then its reply, ...).
            assert r.prompt[: len(prev)] == prev and len(r.prompt) > len(prev)
            assert r.shared_tokens > len(prev)
        last[r.session] = r.prompt
    assert turns > 100  # most requests are a later turn of a conversation
    assert build_workload("multiturn", 50, seed=1) == build_workload("multiturn", 50, seed=1)


def test_cache_pressure_sizes_the_fleet_cache_to_a_fraction_of_the_working_set():
    doc = toks(7, 64)
    reqs = [WorkloadRequest(prompt=doc + toks(100 + i, 4), max_tokens=4, prefix_id="d",
                            output_len=4) for i in range(50)]
    blocks = working_set_blocks(reqs)
    assert blocks == 64 + 50 * 4
    assert pressure_blocks(reqs, 1, 2.0) == blocks // 2
    # Never below what the largest request needs: 68 prompt blocks + its output, + 1.
    assert pressure_blocks(reqs, 100, 4.0) == 68 + 1 + 1


def test_ideal_gives_every_gpu_every_prefix_computed_anywhere():
    doc = toks(3, 64)
    reqs = [WorkloadRequest(prompt=doc + toks(50 + i, 2), max_tokens=4, prefix_id="d",
                            output_len=4) for i in range(16)]
    arrivals = [0.0] + [1.0 + 0.001 * i for i in range(15)]  # the first one alone
    ideal = ClusterSim(ClusterConfig(gpus=4, policy="ideal")).run(reqs, arrivals)
    rr = ClusterSim(ClusterConfig(gpus=4, policy="round_robin")).run(reqs, arrivals)
    # After the first request computed the document, every later one hits all of it,
    # wherever it runs; round robin recomputes it once on each GPU it reaches first.
    assert [r.cached_tokens for r in ideal.results[1:]] == [64 * 16] * 15
    assert len([w for w, n in ideal.worker_requests.items() if n]) > 1
    assert sum(r.cached_tokens for r in rr.results) < sum(r.cached_tokens for r in ideal.results)
    mean = lambda run: sum(r.latency_s for r in run.results) / len(run.results)  # noqa: E731
    assert mean(ideal) <= mean(rr)


def test_rows_state_their_distance_from_ideal():
    from prefixmesh.loadgen.ideal import annotate_ideal

    rows = [{"policy": p, "workload": "w", "rate": 1.0, "gpus": 4, "seed": 0,
             "latency_avg_s": avg, "latency_p99_s": 2 * avg}
            for p, avg in (("ideal", 1.0), ("e2", 1.5))]
    annotate_ideal(rows)
    assert rows[1]["vs_ideal_avg"] == 1.5 and rows[1]["vs_ideal_p99"] == 1.5
    assert rows[0]["vs_ideal_avg"] == 1.0


# --------------------------------------------------------------------------- operators' complaints


def test_affinity_is_judged_per_request_not_switched_off_when_one_worker_is_hot():
    p = e2_policy(4)
    docs = {w: toks(500 + i, 200) for i, w in enumerate(("w0", "w1", "w2", "w3"))}
    for w, doc in docs.items():  # each worker holds one document
        p.route(route_input(f"seed-{w}", doc, toks(1, 2), exclude=set(docs) - {w}), 0.0)
    # w0 becomes hot: many long cold prompts land there.
    for i in range(30):
        p.route(route_input(f"hot{i}", toks(900 + i, 400), exclude={"w1", "w2", "w3"}),
                0.1 + 0.01 * i)
    assert p.worker_state("w0").L > 10 * p.worker_state("w1").L
    # Every other document's questions still go to the worker holding it.
    t = 1.0
    for w in ("w1", "w2", "w3"):
        for k in range(3):
            t += 0.01
            d = p.route(route_input(f"q-{w}-{k}", docs[w], toks(50 + k, 2)), t)
            assert (d.worker_id, d.kind) == (w, "exploit")


def test_burst_siblings_are_placed_together_before_any_kv_event():
    p = e2_policy(4)
    prefix = toks(77, 120)  # an agent's context, new to the fleet
    # n = 6 parallel calls at the same instant; no KV event arrives in between.
    got = [p.route(route_input(f"sib{i}", prefix, toks(300 + i, 1)), 5.0) for i in range(6)]
    assert len({d.worker_id for d in got}) == 1
    assert [d.kind for d in got[1:]] == ["exploit"] * 5
    # The decision is an entry of the tree at once (the prediction KV events then confirm).
    node, m = p.tree.match(route_input("x", prefix).block_hashes)
    assert m == 120 and got[0].worker_id in node.workers


def test_e2_does_not_lose_to_round_robin_on_low_sharing_traffic():
    reqs = build_workload("lowshare", 240, seed=0)
    arrivals = [i / 6.0 for i in range(len(reqs))]

    def mean_latency(policy: str) -> float:
        run = ClusterSim(ClusterConfig(gpus=4, policy=policy)).run(reqs, arrivals)
        assert all(r.ok for r in run.results)
        return sum(r.latency_s for r in run.results) / len(run.results)

    assert mean_latency("e2") <= 1.03 * mean_latency("round_robin")


def test_up_starts_one_worker_per_listed_profile(tmp_path):
    from prefixmesh.services.up import LocalMesh, MeshOptions

    mesh = LocalMesh(MeshOptions(gpu_profiles="mistral-7b-h100:1,mistral-7b-a6000:2",
                                 port=0, metrics_port=0, log_dir=tmp_path))
    assert mesh.opts.workers == 3
    assert mesh.worker_profiles == ("mistral-7b-h100", "mistral-7b-a6000", "mistral-7b-a6000")


def test_ideal_under_cache_pressure_keeps_the_cache_consistent():
    # KV so small that a free copy often finds no room: the engines must still run.
    reqs = [WorkloadRequest(prompt=toks(i % 5, 40) + toks(100 + i, 2), max_tokens=8,
                            prefix_id=f"d{i % 5}", output_len=8) for i in range(60)]
    cfg = ClusterConfig(gpus=2, policy="ideal", engine_config=SimEngineConfig(num_blocks=60))
    run = ClusterSim(cfg).run(reqs, [0.01 * i for i in range(60)])
    assert all(r.ok for r in run.results)


def test_route_audit_classifies_every_decision():
    from prefixmesh.loadgen.options import WorkloadSpec
    from prefixmesh.loadgen.route_audit import audit

    classes, avg, hit = audit(WorkloadSpec("toolbench", seed=0), "round_robin", 4, 20.0,
                              3.0, 3.0)
    assert sum(classes.values()) == 60 and avg > 0 and 0 < hit < 1
    # Round robin ignores the caches: some repeat of a prefix lands on a new GPU.
    assert sum(c for k, c in classes.items() if k[3] == "new_home") > 0
    assert sum(c for k, c in classes.items() if k[3] == "first") >= 1


def test_e2_costs_are_what_route_compares():
    p = e2_policy(2)
    p.route(route_input("a", toks(1, 200)), 0.0)  # w? now caches toks(1) and has a backlog
    probe = route_input("b", toks(2, 200))
    terms, costs = p.explain(probe, 0.01), p.costs(probe, 0.01)
    assert costs.keys() == terms.keys() == {"w0", "w1"}
    for w, (load, m, prefill) in terms.items():
        assert costs[w] >= load + m + prefill
    # A cold prompt explores: it goes to the cheaper worker by these costs.
    assert p.route(probe, 0.01).worker_id == min(costs, key=costs.__getitem__)


def test_route_audit_prices_e2_new_homes():
    from prefixmesh.loadgen.options import WorkloadSpec
    from prefixmesh.loadgen.route_audit import audit

    why: list[str] = []
    per_gpu: dict[str, dict[str, float]] = {}
    classes, _, hit = audit(WorkloadSpec("toolbench", seed=0), "e2", 4, 54.72, 10.0, 3.0, why,
                            per_gpu)
    assert len(why) == sum(c for k, c in classes.items() if k[3] == "new_home") > 0
    assert sum(g["requests"] for g in per_gpu.values()) == sum(classes.values())
    cached = sum(g["cached"] for g in per_gpu.values())
    assert cached / sum(g["prompt"] for g in per_gpu.values()) == pytest.approx(hit)
    assert all("old home" in line and "backlog + interference" in line for line in why)


def test_route_audit_takes_policy_variants_with_several_knobs(
        capsys: pytest.CaptureFixture[str]) -> None:
    from prefixmesh.loadgen.route_audit import main

    assert main(["--workload", "toolbench", "--rate", "20", "--duration", "2",
                 "--policies", "e2:th_bal=inf,affinity_prefill_slack=0,cache_aware"]) == 0
    out = capsys.readouterr().out
    assert "e2:th_bal=inf,affinity_prefill_slack=0: avg" in out and "cache_aware: avg" in out


def test_route_audit_lists_the_slowest_requests(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    from prefixmesh.loadgen.route_audit import main

    assert main(["--workload", "toolbench", "--gpus", "2", "--rate", "20", "--duration", "2",
                 "--policies", "round_robin", "--slowest", "5"]) == 0
    out = capsys.readouterr().out
    listed = re.findall(r"r\d+ at +[\d.]+ s: +([\d.]+) s, first token .* -> (gpu\d) "
                        r"\(round_robin\)", out)
    assert "slowest 5:" in out and len(listed) == 5
    latencies = [float(lat) for lat, _ in listed]
    assert latencies == sorted(latencies, reverse=True) and latencies[-1] > 0
    with pytest.raises(SystemExit):
        main(["--workload", "toolbench", "--rate", "20", "--slowest", "-1"])


def test_route_audit_replays_a_sweeps_lighter_point_on_the_requests_it_ran() -> None:
    """A sweep draws its requests for its heaviest rate and replays the first ones at the
    lighter rates; ``--draw`` makes the audit do the same, so its run is that point's."""
    from prefixmesh.loadgen.options import WorkloadSpec
    from prefixmesh.loadgen.route_audit import audit
    from prefixmesh.loadgen.sweep import sweep
    from prefixmesh.shared.costmodel import DEFAULT_PROFILE

    spec = WorkloadSpec("loogle:0.3,toolbench:0.7", seed=1)
    rows = sweep(spec, 2, [2.0, 6.0], ["round_robin"], ["prefix_fair"], DEFAULT_PROFILE, 4.0,
                 progress=False)
    light = next(r for r in rows if r["rate"] == 2.0)
    _, avg, _ = audit(spec, "round_robin", 2, 2.0, 4.0, 0.0, draw=24)
    assert avg == pytest.approx(light["latency_avg_s"], rel=1e-9)
    _, own, _ = audit(spec, "round_robin", 2, 2.0, 4.0, 0.0)  # its own 8 requests
    assert own != pytest.approx(avg, rel=1e-6)


def test_route_audit_shows_e2s_view_of_each_gpu_during_the_run() -> None:
    import re

    from prefixmesh.loadgen.options import WorkloadSpec
    from prefixmesh.loadgen.route_audit import audit

    spec = WorkloadSpec("toolbench", seed=0)
    state: list[str] = []
    audit(spec, "e2", 2, 20.0, 3.0, 0.0, state=state, state_every_s=1.0)
    marks = [float(m) for m in re.findall(r"^at +([\d.]+) s:$", "\n".join(state), re.M)]
    # Once a second of arrivals (Poisson: the last may come a little after 3 s).
    assert len(marks) >= 2 and all(i + 1 <= t < i + 2 for i, t in enumerate(marks))
    gpus = [ln for ln in state if ln.startswith("  gpu")]
    view = re.compile(r"L +[\d.]+ s, +\d+ in the window, +\d+ in flight")
    assert len(gpus) == 2 * len(marks) and all(view.search(g) for g in gpus)
    later = int(re.search(r"(\d+) in the window", gpus[2]).group(1))  # type: ignore[union-attr]
    assert later > 0  # by 2 s, requests were routed to gpu0
    none: list[str] = []
    audit(spec, "round_robin", 2, 20.0, 3.0, 0.0, state=none, state_every_s=1.0)
    assert none == []  # only E2 has a view to show


def test_suite_judges_an_e2_variant_under_the_e2_label(tmp_path) -> None:
    import json

    from prefixmesh.loadgen.suite import main

    out = tmp_path / "suite.json"
    assert main(["--suite", "quick", "--only", "multiturn-4gpu", "--seeds", "0",
                 "--requests", "30", "--e2", "th_bal=inf", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    e2_rows = [r for r in got["runs"] if r["policy"] == "e2"]
    assert got["e2_knobs"] == "th_bal=inf" and len(e2_rows) == 3  # one per load
    assert all(r["e2_knobs"] == "th_bal=inf" for r in e2_rows)
    assert all("e2" in s["policies"] for s in got["summary"]["multiturn-4gpu"])


@pytest.mark.parametrize(("args", "named"), [
    (["--only", "doc0.1-4gpu-poisson,nosuch"], "--only: no configuration 'nosuch'"),
    (["--e2", "nosuch=1"], "no knob 'nosuch'"),
    (["--e2", "interference_weight=abc"], "interference_weight"),
    (["--horizon", "-5"], "--horizon must be 0 or more"),
    (["--seeds", "0,x"], "--seeds: expected comma-separated integers"),
    (["--requests", "0"], "--requests must be at least 1"),
    (["--requests-per-gpu", "0"], "--requests-per-gpu must be at least 1"),
    (["--requests", "500", "--requests-per-gpu", "125"], "give one"),
])
def test_suite_refuses_bad_arguments_before_running_anything(
        tmp_path, capsys: pytest.CaptureFixture[str], args: list[str], named: str) -> None:
    from prefixmesh.loadgen.suite import main

    out = tmp_path / "suite.json"
    with pytest.raises(SystemExit) as exc:
        main(["--suite", "family", "--json", str(out), *args])
    assert exc.value.code == 2 and named in capsys.readouterr().err
    assert not out.exists()  # nothing run, no earlier results overwritten


def test_suite_capacity_under_cache_pressure_is_the_peers_knee_on_the_pressured_pool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from prefixmesh.loadgen import suite
    from prefixmesh.loadgen.ideal import IDEAL
    from prefixmesh.loadgen.options import WorkloadSpec

    monkeypatch.setattr(suite, "PROBE_REQUESTS", 40)  # short probes: seconds, not minutes
    monkeypatch.setattr(suite, "PROBE_S", 5.0)
    probes: list[tuple[str, int | None]] = []

    class Recorder(ClusterSim):
        def __init__(self, cfg: ClusterConfig) -> None:
            engine = cfg.engine_config
            probes.append((cfg.policy, engine.num_blocks if engine else None))
            super().__init__(cfg)

    monkeypatch.setattr(suite, "ClusterSim", Recorder)
    pressured = next(c for c in suite.FAMILY if c.name == "pressure3-toolbench")
    plain = replace(pressured, name="toolbench-4gpu", cache_pressure=0.0)

    cap_plain = suite.capacity(plain, 0, requests=60)
    # Without pressure: ideal's knee, on the profile's pool, as before.
    assert probes and all(p == (IDEAL, None) for p in probes)
    probes.clear()
    cap_pressured = suite.capacity(pressured, 0, requests=60)
    # Under pressure: only E2's peers (never E2, never ideal), each GPU with the pool of the
    # heaviest run (its 60 requests' working set, 3x the fleet's cache).
    pool = pressure_blocks(WorkloadSpec("toolbench", seed=0).requests(60), 4, 3.0)
    assert {p for p, _ in probes} <= set(suite.PEERS) and "e2" not in suite.PEERS
    assert len({p for p, _ in probes}) > 1  # the light load's latency is the best of them
    assert all(blocks == pool for _, blocks in probes)
    # The pressured fleet saturates sooner than ideal with 8x the profile's KV.
    assert 0 < cap_pressured < cap_plain


def test_suite_runs_every_load_of_a_pressured_configuration_on_one_fleet(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under cache pressure each seed's KV pool is set once, from the heaviest run's
    requests, and every load and policy runs on it (a lighter load is the same fleet less
    busy, not a smaller fleet); the rows say which pool."""
    from prefixmesh.loadgen import suite
    from prefixmesh.loadgen.options import WorkloadSpec

    monkeypatch.setattr(suite, "capacity", lambda cfg, seed, requests: 20.0)
    pools: list[int | None] = []

    class Recorder(ClusterSim):
        def __init__(self, cfg: ClusterConfig) -> None:
            pools.append(cfg.engine_config.num_blocks if cfg.engine_config else None)
            super().__init__(cfg)

    monkeypatch.setattr("prefixmesh.loadgen.sweep.ClusterSim", Recorder)
    cfg = next(c for c in suite.FAMILY if c.name == "pressure3-toolbench")
    rows = suite.run_config(cfg, [0], requests=40)
    want = suite.fleet_blocks(cfg, WorkloadSpec("toolbench", seed=0), 40)
    # The lightest load alone would have had a smaller pool.
    light = round(40 * suite.LOADS[0] / suite.LOADS[-1])
    assert pressure_blocks(WorkloadSpec("toolbench", seed=0).requests(light), 4, 3.0) < want
    assert len(rows) == len(suite.LOADS) * len(suite.POLICIES)
    assert all(r["num_blocks"] == want and r["cache_pressure"] == 3.0 for r in rows)
    assert pools and set(pools) == {want}


def test_suite_runs_span_the_horizon_at_the_heaviest_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast fleet's runs are not its cold start alone: the heaviest load's run holds
    ``horizon_s`` seconds of arrivals when ``requests`` would cover fewer, and every load
    the same duration; ``horizon_s=0`` keeps the count."""
    from prefixmesh.loadgen import suite
    from prefixmesh.loadgen.ideal import IDEAL

    assert suite.run_requests(10.0, 40, 5.0) == 50
    assert suite.run_requests(4.0, 40, 5.0) == 40  # the floor
    assert suite.run_requests(1e4, 40, 60.0) == 4 * suite.PROBE_REQUESTS  # the probes' cap
    assert suite.run_requests(1e4, 5000, 60.0) == 5000  # an explicit count above it holds
    monkeypatch.setattr(suite, "capacity", lambda cfg, seed, requests: 20.0)
    monkeypatch.setattr(suite, "POLICIES", ("e2", "cache_aware", IDEAL))
    monkeypatch.setattr(suite, "PEERS", ("cache_aware",))
    cfg = next(c for c in suite.FAMILY if c.name == "multiturn-4gpu")
    heavy = suite.LOADS[-1] * 20.0  # 18 req/s
    rows = suite.run_config(cfg, [0], requests=40, horizon_s=5.0)
    assert {r["requests_heaviest"] for r in rows} == {round(heavy * 5.0)}
    counts = {r["load"]: r["requests"] for r in rows}
    assert counts[suite.LOADS[-1]] == round(heavy * 5.0)
    assert counts[suite.LOADS[0]] == round(suite.LOADS[0] * 20.0 * 5.0)
    fixed = suite.run_config(cfg, [0], requests=40, horizon_s=0.0)
    assert {r["requests"] for r in fixed if r["load"] == suite.LOADS[-1]} == {40}


def test_the_mixed_suite_runs_every_policy_on_the_mixed_fleet(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from prefixmesh.loadgen import suite
    from prefixmesh.loadgen.suite import MIXED_FLEET, main

    monkeypatch.setattr(suite, "PROBE_REQUESTS", 40)  # short probes: seconds, not minutes
    monkeypatch.setattr(suite, "PROBE_S", 5.0)
    out = tmp_path / "mixed.json"
    assert main(["--suite", "mixed", "--only", "mixed-multiturn", "--seeds", "0",
                 "--requests", "40", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [c["name"] for c in got["configs"]] == ["mixed-multiturn"]
    assert {r["gpu_profiles"] for r in got["runs"]} == {MIXED_FLEET}
    e2 = [r for r in got["runs"] if r["policy"] == "e2"]
    # E2 prices each GPU by its own profile: the two H100s (the first two workers) take
    # more of the requests than the two A6000s at every load.
    for r in e2:
        counts = sorted(r["worker_requests"].items())
        assert sum(c for _, c in counts[:2]) > sum(c for _, c in counts[2:]), counts


def test_suite_runs_the_same_requests_per_gpu_on_every_fleet_size(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from prefixmesh.loadgen import suite

    seen: dict[str, int] = {}

    def fake_run(cfg, seeds, requests, e2_knobs="", horizon_s=0.0):
        seen[cfg.name] = requests
        return []

    monkeypatch.setattr(suite, "run_config", fake_run)
    monkeypatch.setattr(suite, "summarize_config", lambda rows: [])
    names = "doc0.1-4gpu-poisson,doc0.5-8gpu-azconv,doc0.3-16gpu-poisson,hetero-h100+a6000-doc0.3"
    out = tmp_path / "s.json"
    assert suite.main(["--suite", "family", "--only", names, "--requests-per-gpu", "50",
                       "--json", str(out)]) == 0
    assert seen == {"doc0.1-4gpu-poisson": 200, "doc0.5-8gpu-azconv": 400,
                    "doc0.3-16gpu-poisson": 800, "hetero-h100+a6000-doc0.3": 200}
    seen.clear()
    assert suite.main(["--suite", "family", "--only", names, "--json", str(out)]) == 0
    assert seen == {"doc0.1-4gpu-poisson": 500, "doc0.5-8gpu-azconv": 1000,  # the default
                    "doc0.3-16gpu-poisson": 2000, "hetero-h100+a6000-doc0.3": 500}
    seen.clear()
    assert suite.main(["--suite", "family", "--only", names, "--requests", "300",
                       "--json", str(out)]) == 0
    assert set(seen.values()) == {300}  # one count for every fleet
