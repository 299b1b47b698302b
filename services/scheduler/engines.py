"""Which engine instance each worker runs, to tell an engine restart (pure: no I/O).

A worker names its engine instance in every load report and KV batch (``engine_id``, new
at each engine start). Another id under a known worker id is a restarted engine: its
cache is empty whatever the scheduler's tree still holds for that worker, and its KV
sequence starts over. A load report tells it within one report period, before the new
engine has cached anything to send KV events about, where the sequence number alone would
wait for its first KV batch. Workers that send no id ("") are left to the sequence check.
"""

from __future__ import annotations

# Replaced engine ids remembered per worker.
MAX_RETIRED = 16


class EngineIds:
    """The latest engine id seen for each worker, and the ids it has replaced."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}
        # Ids a worker's restarts replaced: load reports and KV batches come on separate
        # subscriptions, so one of the old engine's may still arrive after the new id was
        # seen; it is stale, not another restart.
        self.retired: dict[str, set[str]] = {}

    def stale(self, worker: str, engine_id: str) -> bool:
        """True when ``engine_id`` is an engine ``worker`` has already replaced."""
        return bool(engine_id) and engine_id in self.retired.get(worker, ())

    def restarted(self, worker: str, engine_id: str) -> bool:
        """Note ``engine_id`` for ``worker``; True when it replaces another one (a retired
        id never does: ask ``stale`` first and drop what it carries)."""
        if not engine_id or self.stale(worker, engine_id):
            return False
        old = self.ids.get(worker)
        self.ids[worker] = engine_id
        if old is None or old == engine_id:
            return False
        retired = self.retired.setdefault(worker, set())
        if len(retired) >= MAX_RETIRED:
            retired.clear()  # restarts this many are long past: their messages are too
        retired.add(old)
        return True
