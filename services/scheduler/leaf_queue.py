"""The prefix tree's budget order: ``(last_access, nid, node)`` entries popped smallest
first, as one heap would pop them, without a heap's sift through every level for most.

Most entries come in order: a new leaf is pushed with the newest time there is. Those go
at the end of a sorted run (a deque: push and pop O(1)); the few that come out of order
(a parent that becomes a leaf, an entry pushed again with its node's later time) go to
a heap beside it, and a pop takes the smaller of the two heads. The order of the pops is
the one heap's order (``tests/unit/test_leaf_queue.py`` checks it against ``heapq``).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

E = TypeVar("E", bound=tuple)


class LeafQueue(Generic[E]):
    """Entries (tuples, compared as tuples) popped smallest first."""

    __slots__ = ("_run", "_heap")

    def __init__(self, entries: Iterable[E] = ()) -> None:
        # A compaction's entries come mostly in order, which Timsort sorts in near linear time.
        self._run: deque[E] = deque(sorted(entries))
        self._heap: list[E] = []

    def push(self, entry: E) -> None:
        run = self._run
        if not run or not entry < run[-1]:
            run.append(entry)
        else:
            heapq.heappush(self._heap, entry)

    def pop(self) -> E:
        """The smallest entry (IndexError when empty)."""
        heap, run = self._heap, self._run
        if heap and (not run or heap[0] < run[0]):
            return heapq.heappop(heap)
        return run.popleft()

    def __len__(self) -> int:
        return len(self._run) + len(self._heap)

    def __iter__(self) -> Iterator[E]:
        """Every entry, in no particular order."""
        yield from self._run
        yield from self._heap
