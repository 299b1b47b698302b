"""Workloads built from the real data: reproducibility, valid ids, sharing structure, stats."""

from __future__ import annotations

import io
from collections import Counter, defaultdict
from contextlib import redirect_stdout

import pytest

from prefixmesh.loadgen.stats import main as stats_main
from prefixmesh.loadgen.stats import workload_stats
from prefixmesh.loadgen.workloads import (
    WORKLOADS,
    WorkloadRequest,
    build_mix,
    build_workload,
    make_options,
    parse_mix,
    toolbench_text,
    zipf_weights,
)
from prefixmesh.loadgen.workloads.base import VOCAB_SIZE, rescale_lengths
from prefixmesh.loadgen.workloads.registry import mix_counts
from prefixmesh.loadgen.workloads.sources import loogle_documents, nextqa_data
from prefixmesh.loadgen.workloads.videoqa import video_tokens

ALL = ("toolbench", "embodied", "programming", "videoqa", "loogle", "sharegpt", "multiturn",
       "lowshare",
       "postrec", "creditver", "batch")


def _groups(reqs: list[WorkloadRequest], key: str) -> dict[str, list[WorkloadRequest]]:
    out: dict[str, list[WorkloadRequest]] = defaultdict(list)
    for r in reqs:
        out[getattr(r, key)].append(r)
    return out


def test_registry_has_every_workload() -> None:
    assert set(WORKLOADS) == set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_reproducible_by_seed_with_valid_token_ids(name: str) -> None:
    a = build_workload(name, 12, seed=3)
    assert a == build_workload(name, 12, seed=3)
    assert a != build_workload(name, 12, seed=4)
    assert len(a) == 12
    for r in a:
        assert isinstance(r.prompt, list) and r.prompt
        assert all(isinstance(t, int) and 0 <= t < VOCAB_SIZE for t in r.prompt)
        assert r.output_len >= 1 and r.max_tokens == r.output_len
        assert 0 < r.shared_tokens <= len(r.prompt)


def test_toolbench_requests_of_a_prefix_share_its_leading_tokens() -> None:
    reqs = build_workload("toolbench", 300, seed=1)
    groups = _groups(reqs, "prefix_id")
    assert any(len(g) > 1 for g in groups.values())
    heads = {}
    for pid, group in groups.items():
        n = group[0].shared_tokens
        head = group[0].prompt[:n]
        assert all(r.shared_tokens == n and r.prompt[:n] == head for r in group)
        heads[pid] = tuple(head)
    assert len(set(heads.values())) == len(heads)  # distinct prefixes are distinct tokens


def test_toolbench_popularity_is_zipf() -> None:
    reqs = build_workload("toolbench", 4000, seed=0, zipf=1.1, prefixes=10)
    counts = Counter(r.prefix_id for r in reqs)
    expected_top = 1.0 / zipf_weights(10, 1.1)[-1]
    assert counts.most_common(1)[0][0] == "tool0"
    assert abs(counts["tool0"] / len(reqs) - expected_top) < 0.03
    assert counts["tool0"] > 3 * counts["tool9"]


def test_toolbench_output_lengths_match_table1() -> None:
    stats = workload_stats(build_workload("toolbench", 1000, seed=0))
    assert abs(stats["output_mean"] - 43) < 3 and abs(stats["output_std"] - 16) < 3


def test_rescale_lengths_keeps_order_and_hits_target() -> None:
    real = [5, 1, 9, 3, 7, 2, 8, 4, 6, 10] * 20
    out = rescale_lengths(real, 100, 10)
    pairs = sorted(zip(real, out))
    assert all(b[1] >= a[1] for a, b in zip(pairs, pairs[1:]))  # longer real -> not shorter
    assert abs(sum(out) / len(out) - 100) < 1


def test_videoqa_questions_on_a_video_share_its_tokens() -> None:
    reqs = build_workload("videoqa", 60, seed=2)
    groups = _groups(reqs, "prefix_id")
    assert max(len(g) for g in groups.values()) > 1
    for group in groups.values():
        n = group[0].shared_tokens
        assert all(r.prompt[:n] == group[0].prompt[:n] for r in group)
        assert len({tuple(r.prompt[n:]) for r in group}) == len(group)  # distinct questions
    video = nextqa_data().videos[0]
    ids = video_tokens(video.video, video.frame_count)
    assert ids == video_tokens(video.video, video.frame_count)
    assert len(ids) == video.frame_count * 256 // 30
    assert ids != video_tokens(video.video, video.frame_count, variant=1)


def test_embodied_steps_extend_the_previous_step() -> None:
    reqs = build_workload("embodied", 80, seed=0, agents=4)
    episodes = _groups(reqs, "session")
    assert len(episodes) > 3
    demo_prefix: dict[str, tuple[int, ...]] = {}
    for steps in episodes.values():
        first = steps[0]
        head = tuple(first.prompt[: first.shared_tokens])
        assert demo_prefix.setdefault(first.prefix_id, head) == head
        for prev, step in zip(steps, steps[1:]):
            assert step.prompt[: len(prev.prompt)] == prev.prompt
            assert step.shared_tokens == len(prev.prompt)
    # Episodes are interleaved: the first requests come from more than one episode.
    assert len({r.session for r in reqs[:8]}) > 1


def test_programming_samples_repeat_one_prompt() -> None:
    reqs = build_workload("programming", 24, seed=0, samples=4)
    for k in range(0, 24, 4):
        group = reqs[k: k + 4]
        assert len({r.session for r in group}) == 1
        assert all(r.prompt == group[0].prompt for r in group)
        assert group[0].prompt is not group[1].prompt  # each request owns its list


def test_loogle_variants_make_more_prefixes_than_documents() -> None:
    n_docs = len(loogle_documents())
    reqs = build_workload("loogle", 2 * (n_docs + 3), seed=0, prefixes=n_docs + 3)
    groups = _groups(reqs, "prefix_id")
    assert len(groups) == n_docs + 3
    heads = {tuple(g[0].prompt[: g[0].shared_tokens]) for g in groups.values()}
    assert len(heads) == n_docs + 3
    assert all(r.output_len <= 35 for r in reqs)


def test_prefillonly_profiles() -> None:
    post = build_workload("postrec", 100, seed=0)
    users = _groups(post, "prefix_id")
    assert len(users) == 20 and all(len(u) == 5 for u in users.values())
    assert all(r.output_len == 1 for r in post)
    profile = [u[0].shared_tokens for u in users.values()]
    assert 12_000 < sum(profile) / len(profile) < 16_000
    for u in users.values():  # 150-token posts differ after the shared profile
        assert all(len(r.prompt) - r.shared_tokens > 150 for r in u)
    credit = build_workload("creditver", 60, seed=0)
    assert len({r.prefix_id for r in credit}) == 60
    assert all(40_000 < r.shared_tokens < 60_100 and r.output_len == 1 for r in credit)


def test_batch_groups_share_a_document_and_a_batch_id() -> None:
    reqs = build_workload("batch", 60, seed=0, jobs=2)
    assert {r.batch_id for r in reqs} == {"batch0-0", "batch0-1"}
    for group in _groups(reqs, "prefix_id").values():
        n = group[0].shared_tokens
        assert all(r.prompt[:n] == group[0].prompt[:n] for r in group)
        assert len({r.batch_id for r in group}) == 1


def test_sharegpt_has_little_sharing() -> None:
    stats = workload_stats(build_workload("sharegpt", 50, seed=0))
    assert stats["prefixes"] == 50 and stats["shared_fraction"] < 0.5


def test_build_mix_proportions_and_order() -> None:
    reqs = build_mix("toolbench:0.75,videoqa:0.25", 40, seed=0)
    kinds = Counter(r.prefix_id.rstrip("0123456789") for r in reqs)
    assert kinds == {"tool": 30, "video": 10}
    assert reqs == build_workload("toolbench:0.75,videoqa:0.25", 40, seed=0)
    assert [r for r in reqs if r.prefix_id.startswith("tool")] == build_workload(
        "toolbench", 30, seed=0)
    assert mix_counts(parse_mix("toolbench:1,embodied:1,loogle:1"), 10) == [4, 3, 3]
    assert mix_counts(parse_mix("toolbench:0.1,embodied:0.9"), 7) == [1, 6]
    assert parse_mix("toolbench,videoqa") == [("toolbench", 0.5), ("videoqa", 0.5)]


def test_bad_names_and_options_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope", 3)
    with pytest.raises(ValueError, match="no option"):
        build_workload("toolbench", 3, samples=2)
    with pytest.raises(ValueError, match="no workload of mix"):
        build_mix("toolbench:1,videoqa:1", 3, bogus=1)
    assert make_options("toolbench", zipf=None).zipf is None  # None means the default
    assert build_workload("toolbench", 0) == []


def test_stats_on_a_hand_built_case() -> None:
    a = list(range(32))                      # 2 blocks
    reqs = [
        WorkloadRequest(prompt=a, max_tokens=4, prefix_id="p", output_len=4, shared_tokens=32),
        WorkloadRequest(prompt=a + [7] * 20, max_tokens=8, prefix_id="p", output_len=8,
                        shared_tokens=32),  # 3 full blocks, the first 2 seen before
        WorkloadRequest(prompt=a, max_tokens=6, prefix_id="q", output_len=6, tenant="t"),
    ]  # another tenant's blocks hash differently: nothing shared
    s = workload_stats(reqs)
    assert s["requests"] == 3 and s["prompt_blocks"] == 7
    assert s["shared_fraction"] == pytest.approx(2 / 7)
    assert s["declared_shared_fraction"] == pytest.approx(64 / (32 + 52 + 32))
    assert s["prompt_mean"] == pytest.approx(116 / 3)
    assert s["output_mean"] == pytest.approx(6) and s["output_std"] == pytest.approx(
        (8 / 3) ** 0.5)
    assert s["prefixes"] == 2 and s["requests_per_prefix"] == pytest.approx(1.5)


def test_stats_cli_prints_a_table() -> None:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert stats_main(["--stats", "--count", "5", "toolbench"]) == 0
    assert "| toolbench | 5 |" in buf.getvalue()
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert stats_main([]) == 0
    assert all(name in buf.getvalue() for name in ALL)


def test_toolbench_text_for_the_demo() -> None:
    reqs = toolbench_text(5, seed=0)
    assert all(isinstance(r.prompt, str) and r.output_len == r.max_tokens for r in reqs)
    assert reqs == toolbench_text(5, seed=0)


def test_agents_option_reaches_embodied_from_the_cli_spec() -> None:
    import argparse

    from prefixmesh.loadgen.options import WorkloadSpec, add_workload_args

    p = argparse.ArgumentParser()
    add_workload_args(p)
    spec = WorkloadSpec.from_args(p.parse_args(["--workload", "embodied", "--agents", "40"]))
    assert spec.agents == 40
    reqs = spec.requests(200)
    assert reqs == build_workload("embodied", 200, seed=0, agents=40)
    # More episodes in flight: the first 40 requests come from many more episodes than 4 do.
    few = build_workload("embodied", 200, seed=0, agents=4)
    assert len({r.session for r in reqs[:40]}) > len({r.session for r in few[:40]})
    # Workloads without the option reject it only when it is given.
    assert WorkloadSpec(workload="toolbench").requests(5)
    with pytest.raises(ValueError, match="agents"):
        WorkloadSpec(workload="toolbench", agents=4).requests(5)


@pytest.mark.parametrize(("argv", "named"), [
    (["--workload", "nosuch"], "--workload: unknown workload 'nosuch'"),
    (["--workload", "loogle:0.3,nosuch:0.7"], "--workload: unknown workload 'nosuch'"),
    (["--workload", "toolbench", "--mix", "toolbench:x"], "--mix: bad weight"),
    (["--workload", "toolbench", "--arrivals", "azure"], "--arrivals: unknown arrival"),
])
def test_the_cli_spec_names_an_unknown_workload_or_arrival_process(argv: list[str],
                                                                   named: str) -> None:
    import argparse

    from prefixmesh.loadgen.options import WorkloadSpec, add_workload_args

    p = argparse.ArgumentParser()
    add_workload_args(p)
    with pytest.raises(SystemExit, match=named):
        WorkloadSpec.from_args(p.parse_args(argv))
    assert WorkloadSpec.from_args(p.parse_args(["--workload", "loogle:0.3,toolbench:0.7",
                                                "--arrivals", "burst:8"])).arrivals == "burst:8"
