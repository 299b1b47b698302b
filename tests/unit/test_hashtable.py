"""The block index's table: the C ``HashTable`` against a dict, and its ``DictTable``
stand-in (services/scheduler/_hashtable.c, block_index.py)."""

from __future__ import annotations

import random
import sys
from array import array

import pytest

from tests.helpers import index_table


@pytest.fixture(params=["c", "dict"])
def table(request: pytest.FixtureRequest) -> type:
    return index_table(request.param)


class _Obj:
    pass


EDGES = [0, 1, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64, 10**30]


def test_puts_and_gets_as_a_dict_would(table: type) -> None:
    """Random runs, packed (int64 buffers) and as lists, many overwriting earlier keys,
    with keys at and beyond the int64 range: every key finds its last value, absent ones
    None, and the length counts keys once."""
    rng = random.Random(7)
    t = table(1000)
    ref: dict[int, object] = {}
    keys: list[int] = []
    objs = [_Obj() for _ in range(50)]
    for i in range(5000):
        fresh = [rng.getrandbits(64) - 2**63 for _ in range(rng.randint(0, 30))]
        again = [rng.choice(keys) for _ in range(rng.randint(0, 5))] if keys else []
        keys += fresh
        hashes = fresh + again
        value = rng.choice(objs)
        if i % 3 == 0:
            t.put(hashes, value)  # ints, not a buffer
        else:
            t.put(array("q", hashes), value)
        ref.update(dict.fromkeys(hashes, value))
    t.put(EDGES, objs[0])
    ref.update(dict.fromkeys(EDGES, objs[0]))
    assert len(t) == len(ref)
    assert all(t.get(h) is v for h, v in ref.items())
    assert all(t.get(rng.getrandbits(64) - 2**63) is None for _ in range(1000))
    assert t.get(2**65) is None and t.get(-(2**65)) is None
    # Each value still pointed at comes out (a table may also list one that every hash of
    # its put has left since: BlockIndex checks what it finds).
    listed = set(map(id, t.values()))
    assert set(map(id, ref.values())) <= listed <= set(map(id, objs))


def test_a_table_grows_past_the_entries_it_was_made_for(table: type) -> None:
    t = table(10)
    t.put(range(10_000), "v")
    assert len(t) == 10_000 and t.get(9_999) == "v" and t.get(10_000) is None


def test_bad_input_is_a_type_error_naming_it() -> None:
    t = index_table("c")()
    with pytest.raises(TypeError, match="int64"):
        t.put(array("i", [1, 2]), "v")  # int32s
    with pytest.raises(TypeError, match="integer"):
        t.put([1, "x"], "v")
    with pytest.raises(TypeError, match="integer"):
        t.get("x")
    with pytest.raises(TypeError):
        t.put([1])
    with pytest.raises(ValueError, match="entries"):
        index_table("c")(-1)


def test_values_are_held_once_a_put_and_released_with_the_table() -> None:
    """The C table holds one reference per put (not per hash), keeps it while a key of
    that put moves to another value, and gives every one back when dropped."""
    a, b = _Obj(), _Obj()
    before = sys.getrefcount(a), sys.getrefcount(b)
    t = index_table("c")()
    t.put(array("q", range(100)), a)
    t.put([2**70, 5], b)  # a key beyond int64 (held by the dict beside), one moved to b
    assert t.get(5) is b and t.get(4) is a and t.get(2**70) is b
    assert sys.getrefcount(a) == before[0] + 1 and sys.getrefcount(b) == before[1] + 2
    assert [id(v) for v in t.values()] == [id(a), id(b), id(b)]  # puts in order, then big
    del t
    assert (sys.getrefcount(a), sys.getrefcount(b)) == before
