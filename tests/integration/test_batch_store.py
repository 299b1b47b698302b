"""BatchStore on a real JetStream: records, file bytes, results recorded at most once."""

from __future__ import annotations

import nats
import pytest

from prefixmesh.services.edge.batch_format import BatchRecord, FileRecord, LineResult
from prefixmesh.services.edge.batch_store import BatchStore

pytestmark = pytest.mark.timeout(30)


async def test_store_round_trip_and_idempotent_results(nats_server: str, prefix: str) -> None:
    nc = await nats.connect(nats_server)
    try:
        store = await BatchStore.open(nc, prefix)
        data = b'{"custom_id": "a"}\n' * 5000  # several object-store chunks
        await store.put_file(FileRecord("file-1", len(data), 1, "in.jsonl", "batch", 5000), data)
        assert (await store.get_file("file-1")).lines == 5000
        assert await store.file_content("file-1") == data
        assert await store.get_file("file-2") is None
        rec = BatchRecord(id="batch_1", endpoint="/v1/completions", input_file_id="file-1",
                          completion_window="24h", status="in_progress", created_at=5)
        await store.put_batch(rec)
        await store.put_batch(BatchRecord(id="batch_2", endpoint="/v1/completions",
                                          input_file_id="file-1", completion_window="24h",
                                          status="completed", created_at=6))
        assert [b.id for b in await store.list_batches()] == ["batch_2", "batch_1"]
        assert await store.line_results("batch_1") == {}
        first = LineResult("a", 200, "batch_1-0", {"x": 1})
        assert await store.record_line("batch_1", 0, first)
        assert not await store.record_line("batch_1", 0, LineResult("a", 500, "r", {}))
        assert await store.record_line("batch_1", 7, LineResult("b", 400, "batch_1-7", {}))
        got = await store.line_results("batch_1")
        assert got == {0: first, 7: LineResult("b", 400, "batch_1-7", {})}
        # A second handle (another edge, or a restarted one) sees the same state.
        again = await BatchStore.open(nc, prefix)
        assert (await again.get_batch("batch_1")).status == "in_progress"
    finally:
        await nc.close()
