"""Active-active replicas, pure part: a peer's decisions charged as one's own, and when a
booting replica may route (services/scheduler/replicas.py)."""

from __future__ import annotations

import msgspec
import pytest

from prefixmesh.services.scheduler.policies import POLICY_NAMES, make_policy
from prefixmesh.services.scheduler.policies.base import Decision, PolicyConfig, RouteInput
from prefixmesh.services.scheduler.replicas import (
    CatchUp,
    Peers,
    apply_peer_decisions,
    route_input,
    routed,
    routed_hashes,
)
from prefixmesh.shared.blocks import BLOCK_SIZE, block_hashes
from prefixmesh.shared.wire import (
    BUS_EVENT,
    ROUTE_REQUEST,
    AllBlocksCleared,
    BlockStored,
    RoutingDecisionsEvent,
    SamplingParams,
    TokenizedRequest,
    encode,
    routing_copy,
)
from tests.helpers import default_cost

WORKERS = ("a", "b", "c")


def _policies(name: str, n: int):
    out = []
    for _ in range(n):
        p = make_policy(name, PolicyConfig(), default_cost())
        for w in WORKERS:
            p.add_worker(w, 0, 0.0)
        out.append(p)
    return out


def _req(i: int) -> RouteInput:
    tokens = [1000 * (i % 5) + t for t in range(8 * BLOCK_SIZE)] + [i] * BLOCK_SIZE
    return RouteInput(request_id=f"r{i}", block_hashes=block_hashes(tokens),
                      prompt_tokens=len(tokens), max_tokens=32)


def _route_split(replicas, n: int, share: bool) -> list[str]:
    """Route ``n`` requests round-robin over the replicas (as a queue group does); with
    ``share`` each decision is told to the others. Returns the chosen workers."""
    chosen = []
    for i in range(n):
        now = 0.01 * (i + 1)
        me = replicas[i % len(replicas)]
        inp = _req(i)
        d = me.route(inp, now)
        chosen.append(d.worker_id)
        if share:
            ev = RoutingDecisionsEvent(scheduler_id=str(i % len(replicas)), ts=now,
                                       decisions=[routed(inp, d)])
            for j, peer in enumerate(replicas):
                assert apply_peer_decisions(peer, ev, str(j), now) == (0 if peer is me else 1)
    return chosen


def test_e2_replicas_that_share_decisions_keep_one_schedulers_load():
    one = _policies("e2", 1)
    three = _policies("e2", 3)
    _route_split(one, 60, share=True)
    _route_split(three, 60, share=True)
    for w in WORKERS:
        loads = [p.worker_state(w).L for p in three]
        # Every replica charged all 60 decisions: its L is the single scheduler's.
        assert loads == pytest.approx([one[0].worker_state(w).L] * 3)
    assert all(len(p.window.entries) == 60 for p in three)


def test_e2_replicas_that_do_not_share_see_a_third_of_the_load():
    """The failure sharing prevents: each replica's L counts only what it routed."""
    three = _policies("e2", 3)
    _route_split(three, 60, share=False)
    assert all(len(p.window.entries) == 20 for p in three)


def test_a_peer_decision_records_the_prefix_in_the_tree():
    a, b = _policies("e2", 2)
    inp = _req(0)
    d = a.route(inp, 1.0)
    apply_peer_decisions(b, RoutingDecisionsEvent(scheduler_id="A", ts=1.0,
                                                  decisions=[routed(inp, d)]), "B", 1.0)
    node, m = b.tree.match(inp.block_hashes)
    assert m == len(inp.block_hashes) and d.worker_id in node.workers
    # b routes the next request of that prefix to the same worker, as a would.
    follow = RouteInput(request_id="r1", block_hashes=inp.block_hashes + [7],
                        prompt_tokens=inp.prompt_tokens + BLOCK_SIZE, max_tokens=32)
    assert b.route(follow, 1.1).worker_id == d.worker_id


def test_a_malformed_peer_decision_is_skipped_and_the_others_applied():
    a, b = _policies("e2", 2)
    inputs = [_req(i) for i in range(3)]  # three prefixes
    records = [routed(inp, a.route(inp, 1.0)) for inp in inputs]
    assert all(r.packed_hashes for r in records)
    records[1] = msgspec.structs.replace(records[1], packed_hashes=b"\x01\x02\x03")
    ev = RoutingDecisionsEvent(scheduler_id="A", ts=1.0, decisions=records)
    assert apply_peer_decisions(b, ev, "B", 1.0) == 2
    for i in (0, 2):
        node, m = b.tree.match(inputs[i].block_hashes)
        assert m == len(inputs[i].block_hashes) and records[i].worker_id in node.workers
    assert b.tree.match(inputs[1].block_hashes)[1] == 0  # the malformed one: not recorded


def test_a_peer_decision_on_a_known_prefix_records_the_path_not_the_tail():
    """The exploit shape (the tree holds most of the prompt): the peer puts the shared
    path on the chosen worker and charges the load, without a node for the tail."""
    a, b = _policies("e2", 2)
    first = _req(0)
    for p in (a, b):  # both know the prefix, on worker "c" (its KV events)
        p.on_kv_events("c", [BlockStored(first.block_hashes[:8], None, [], BLOCK_SIZE)], 0.5)
    inp = _req(5)  # the same 8 shared blocks, its own last block
    d = a.route(inp, 1.0)
    nodes = len(b.tree)
    apply_peer_decisions(b, RoutingDecisionsEvent(scheduler_id="A", ts=1.0,
                                                  decisions=[routed(inp, d)]), "B", 1.0)
    assert len(b.tree) == nodes  # no leaf for the tail
    node, m = b.tree.match(inp.block_hashes)
    assert m == 8 and d.worker_id in node.workers and node.counts == {d.worker_id: 1}
    assert b.worker_state(d.worker_id).L == pytest.approx(a.worker_state(d.worker_id).L)
    # Its siblings follow it on b as on a.
    sib = _req(10)
    assert b.route(sib, 1.1).worker_id == a.route(sib, 1.1).worker_id


def test_a_peer_decision_matching_inside_a_node_puts_the_worker_on_the_matched_part():
    (b,) = _policies("e2", 1)
    doc = list(range(5_000, 5_000 + 8 * BLOCK_SIZE))
    b.on_kv_events("c", [BlockStored(block_hashes(doc), None, [], BLOCK_SIZE)], 0.5)
    tokens = doc[: 6 * BLOCK_SIZE] + [1] * (2 * BLOCK_SIZE)  # 6 of its 8 blocks, then its own
    inp = RouteInput(request_id="p", block_hashes=block_hashes(tokens),
                     prompt_tokens=len(tokens), max_tokens=8)
    nodes = len(b.tree)
    apply_peer_decisions(b, RoutingDecisionsEvent(scheduler_id="A", ts=1.0, decisions=[
        routed(inp, Decision("a", "explore"))]), "B", 1.0)
    assert len(b.tree) == nodes + 1  # the split, no leaf for the two own blocks
    node, m = b.tree.match(inp.block_hashes)
    assert m == 6 and node.end == 6 and set(node.workers) == {"a", "c"}
    assert node.counts == {"a": 1}


def test_a_decision_carries_its_hashes_packed_and_a_peer_reads_them_back():
    inp = _req(2)
    wide = RouteInput(request_id="w", block_hashes=[2**64 - 1, 5], prompt_tokens=32,
                      max_tokens=1)  # not a 64-bit signed hash: sent as a list
    ev = RoutingDecisionsEvent(scheduler_id="A", ts=0.0, decisions=[
        routed(inp, Decision("a", "explore")), routed(wide, Decision("a", "explore"))])
    got = BUS_EVENT.decode(encode(ev))
    assert isinstance(got, RoutingDecisionsEvent)
    packed, listed = got.decisions
    assert packed.block_hashes == [] and len(packed.packed_hashes) == 8 * len(inp.block_hashes)
    assert list(routed_hashes(packed)) == inp.block_hashes
    assert listed.packed_hashes == b"" and list(routed_hashes(listed)) == [2**64 - 1, 5]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_routing_copy_with_packed_hashes_is_routed_as_its_list(name):
    """The edge's packed copy and the same request with a list decide alike, and a
    decision made from packed hashes reaches the peers with them."""
    a, b = _policies(name, 2)
    reqs = [_req(i) for i in range(12)]
    for i, r in enumerate(reqs):
        wire_req = TokenizedRequest(request_id=r.request_id, token_ids=[],
                                    sampling=SamplingParams(max_tokens=r.max_tokens),
                                    block_hashes=list(r.block_hashes),
                                    prompt_tokens=r.prompt_tokens)
        packed = route_input(ROUTE_REQUEST.decode(encode(routing_copy(wire_req))))
        listed = route_input(wire_req)
        assert list(packed.block_hashes) == list(listed.block_hashes) == list(r.block_hashes)
        da, db = a.route(packed, float(i)), b.route(listed, float(i))
        assert (da.worker_id, da.kind, da.matched_tokens) == (db.worker_id, db.kind,
                                                              db.matched_tokens)
        told = routed(packed, da)
        assert told.block_hashes == [] and list(routed_hashes(told)) == list(r.block_hashes)


@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if n != "e2"])
def test_baselines_count_peer_decisions_as_outstanding(name):
    a, b = _policies(name, 2)
    inp = _req(3)
    d = a.route(inp, 1.0)
    w = d.worker_id
    apply_peer_decisions(b, RoutingDecisionsEvent(scheduler_id="A", ts=1.0,
                                                  decisions=[routed(inp, d)]), "B", 1.0)
    assert b.out.count[w] == 1 and b.out.reqs["r3"].worker == w
    # A peer's decision for a worker this replica does not know changes nothing.
    apply_peer_decisions(b, RoutingDecisionsEvent(scheduler_id="A", ts=1.0, decisions=[
        routed(_req(4), Decision("gone", name))]), "B", 1.0)
    assert "r4" not in b.out.reqs


def test_catch_up_waits_for_every_known_worker_to_resend_its_cache():
    c = CatchUp(start=0.0, min_wait_s=0.5, timeout_s=5.0)
    assert c.worker_known("a") and c.worker_known("b")
    assert not c.worker_known("a")  # asked once
    stored = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[], block_size=16)
    c.kv_batch("a", [AllBlocksCleared(), stored])
    c.kv_batch("b", [stored])  # an ordinary batch is not the whole cache
    assert not c.check(1.0)
    c.kv_batch("b", [AllBlocksCleared()])  # b's cache is empty: still a whole state
    assert not c.check(0.4)  # too early: a live worker may not have reported yet
    assert c.check(0.6) and c.how == "synced"
    assert not c.worker_known("z")  # caught up: new workers are ordinary joins


def test_catch_up_gives_up_on_a_silent_worker_at_the_timeout_or_when_it_leaves():
    c = CatchUp(start=0.0, min_wait_s=0.5, timeout_s=5.0)
    c.worker_known("dead")
    assert not c.check(4.9)
    assert c.check(5.0) and c.how == "timeout"
    c = CatchUp(start=0.0, min_wait_s=0.5, timeout_s=5.0)
    c.worker_known("dead")
    c.worker_gone("dead")  # liveness dropped it
    assert c.check(0.6) and c.how == "synced"


def test_with_no_workers_a_replica_routes_after_the_least_wait():
    c = CatchUp(start=10.0, min_wait_s=0.5, timeout_s=5.0)
    assert not c.check(10.2)
    assert c.check(10.5)


def _e2_state(p) -> list:
    """What E2 records of decisions: the tree (runs, caching stamps, counts, last
    access, ids, LRU orders), the window (entries and the rid index) and each worker's
    load, backlog and report use."""
    t = p.tree
    t.flush()
    nodes = sorted((n.nid, n.start, tuple(n.hashes), dict(n.workers), dict(n.counts),
                    n.last_access) for n in t.nodes())
    lru = {w: [n.nid for n in t.worker_lru(w)] for w in sorted(t.worker_blocks)}
    win = p.window
    entries = [(e.t, e.ws.id, e.cost, e.leaf.nid, e.rid, e.dt_tok, e.out_est)
               for e in win.entries]
    workers = [(w, p.worker_state(w).L, p.worker_state(w).n, p.worker_state(w).busy_until,
                p.worker_state(w).pd_used) for w in sorted(p.workers)]
    return [nodes, lru, dict(t.worker_blocks), t.n_nodes, t.next_nid, entries,
            sorted(win.by_rid), workers]


def test_a_peer_decision_off_the_wire_records_what_apply_remote_decision_records():
    """``apply_peer_decisions`` (``apply_routed``: no RouteInput or Decision built) and
    ``apply_remote_decision`` on the same decisions leave identical state: exploit-shape
    decisions (matched path only, at a node's end and inside a node), cold prompts
    (recorded whole), a predicted output, a pd_balance decision, a repeat and a decision
    for an unknown worker. Each window entry also charges what the deciding replica
    charged (the same prefill, output estimate and DT)."""
    a, old, new = _policies("e2", 3)
    doc = list(range(5_000, 5_000 + 8 * BLOCK_SIZE))
    for p in (a, old, new):
        p.on_kv_events("c", [BlockStored(block_hashes(doc), None, [], BLOCK_SIZE)], 0.5)
    reqs = [_req(i) for i in range(12)]  # five shared heads, each with its own block
    reqs.append(RouteInput(request_id="inside", block_hashes=block_hashes(
        doc[: 6 * BLOCK_SIZE] + [1] * (2 * BLOCK_SIZE)), prompt_tokens=8 * BLOCK_SIZE + 3,
        max_tokens=4, predicted_output=9.0))
    decisions = []
    for i, inp in enumerate(reqs):
        decisions.append((inp, a.route(inp, 1.0 + 0.01 * i)))
    decisions.append((_req(20), Decision("b", "pd_balance", 0)))
    decisions.append(decisions[3])  # delivered twice: counts once
    decisions.append((_req(21), Decision("gone", "explore", 0)))
    for k, (inp, d) in enumerate(decisions):
        now = 2.0 + 0.01 * k
        old.apply_remote_decision(inp, d, now)
        ev = BUS_EVENT.decode(encode(RoutingDecisionsEvent(scheduler_id="A", ts=now,
                                                           decisions=[routed(inp, d)])))
        assert isinstance(ev, RoutingDecisionsEvent)
        apply_peer_decisions(new, ev, "B", now)
        assert _e2_state(new) == _e2_state(old)
    assert new.worker_state("b").pd_used
    assert len(new.window.entries) == len(reqs) + 1
    for inp, _ in decisions[: len(reqs)]:
        mine, theirs = new.window.by_rid[inp.request_id], a.window.by_rid[inp.request_id]
        assert (mine.ws.id, mine.cost, mine.out_est, mine.dt_tok) == (
            theirs.ws.id, theirs.cost, theirs.out_est, theirs.dt_tok)


def test_peers_are_known_while_heard_within_their_missed_hellos():
    peers = Peers(hello_s=1.0, missed=3)
    assert not peers.any(0.0)  # alone: nothing to tell
    assert peers.heard("B", 0.0)  # new: answer with a hello
    assert not peers.heard("B", 1.0)  # known: no answer
    assert peers.any(3.9)  # last heard at 1.0, within 3 hellos
    assert not peers.any(4.1)  # silent for more than 3 hellos: forgotten
    assert peers.heard("B", 5.0)  # back: new again
