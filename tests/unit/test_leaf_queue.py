"""The prefix tree's budget order (services/scheduler/leaf_queue.py) pops as one heap."""

from __future__ import annotations

import heapq
import random

import pytest

from prefixmesh.services.scheduler.leaf_queue import LeafQueue


class _Node:  # compared by identity only, as the tree's nodes
    pass


@pytest.mark.parametrize("seed", range(5))
def test_pops_in_the_order_one_heap_pops(seed: int) -> None:
    """Mostly newest-time pushes, some older ones (parents becoming leaves), entries
    pushed again with the same or a later time, pops in between: every pop is the
    heap's."""
    rng = random.Random(seed)
    nodes = [_Node() for _ in range(200)]
    heap: list[tuple[float, int, _Node]] = []
    queue: LeafQueue[tuple[float, int, _Node]] = LeafQueue()
    now = 0.0
    popped = 0
    for _ in range(20_000):
        r = rng.random()
        if r < 0.45:
            now += rng.choice((0.0, 0.5, 1.0))  # ties in time too
            nid = rng.randrange(len(nodes))
            entry = (now, nid, nodes[nid])
        elif r < 0.6:
            nid = rng.randrange(len(nodes))
            entry = (now - rng.uniform(0, 50), nid, nodes[nid])  # out of order
        elif heap:
            a, b = heapq.heappop(heap), queue.pop()
            assert a == b and a[2] is b[2]
            popped += 1
            continue
        else:
            continue
        heapq.heappush(heap, entry)
        queue.push(entry)
        assert len(queue) == len(heap)
    assert sorted(queue) == sorted(heap)
    while heap:
        assert heapq.heappop(heap) == queue.pop()
    assert popped > 1_000 and not queue
    with pytest.raises(IndexError):
        queue.pop()


def test_built_from_entries_in_any_order() -> None:
    rng = random.Random(1)
    node = _Node()
    entries = [(rng.uniform(0, 100), i, node) for i in range(500)]
    queue = LeafQueue(entries)
    assert [queue.pop() for _ in range(500)] == sorted(entries)
