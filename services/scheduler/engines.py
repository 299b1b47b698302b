"""Which engine instance each worker runs, to tell an engine restart (pure: no I/O).

A worker names its engine instance in every load report and KV batch (``engine_id``, new
at each engine start). Another id under a known worker id is a restarted engine: its
cache is empty whatever the scheduler's tree still holds for that worker, and its KV
sequence starts over. A load report tells it within one report period, before the new
engine has cached anything to send KV events about, where the sequence number alone would
wait for its first KV batch. Workers that send no id ("") are left to the sequence check.
"""

from __future__ import annotations


class EngineIds:
    """The latest engine id seen for each worker."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}

    def restarted(self, worker: str, engine_id: str) -> bool:
        """Note ``engine_id`` for ``worker``; True when it replaces another one."""
        if not engine_id:
            return False
        old = self.ids.get(worker)
        self.ids[worker] = engine_id
        return old is not None and old != engine_id
