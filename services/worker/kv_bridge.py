"""The KV-event bridge: vLLM's ZMQ publisher in, prefixmesh KV events out
(docs/design.md section 4).

One task per vLLM worker: a SUB socket on vLLM's publisher endpoint, each message decoded and
translated (``engine.vllm_events``) and handed to ``publish``, which the worker service
sends as a ``KvEventBatch`` with its own per-worker sequence number (the scheduler detects
gaps on that one). Gaps in vLLM's own sequence are repaired from vLLM's replay socket
(ROUTER; we talk to it with a DEALER, which unlike REQ may receive many replies to one
request); when the replay cannot cover the gap (no replay endpoint, timeout, batches already
out of vLLM's replay buffer) the translator is reset and ``AllBlocksCleared`` published: the
scheduler then under-estimates this worker's cache instead of trusting removals it never saw.

pyzmq is imported when the bridge runs, so the worker imports without it (sim backend).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixmesh.services.worker.engine.base import PublishKv
from prefixmesh.services.worker.engine.vllm_events import (
    END_SEQ,
    BlockTranslator,
    SeqGap,
    SeqTracker,
    VllmEventError,
    decode_batch,
    decode_seq,
    encode_seq,
)

if TYPE_CHECKING:
    import zmq.asyncio

log = logging.getLogger(__name__)

# Seconds to wait for each frame of a replay before giving up on it (then: reset).
REPLAY_TIMEOUT_S = 2.0
# vLLM's default topic for --kv-events-config.
DEFAULT_TOPIC = "kv-events"



@dataclass(frozen=True, slots=True)
class KvBridgeConfig:
    """Where vLLM publishes (``KVEventsConfig``'s endpoint, replay_endpoint and topic)."""

    # SUB connects here (vLLM binds ipc:// and tcp://*:port endpoints).
    endpoint: str
    # vLLM's replay ROUTER; "" = none (a gap then always means a reset).
    replay_endpoint: str = ""
    topic: str = DEFAULT_TOPIC
    replay_timeout_s: float = REPLAY_TIMEOUT_S
    # Sequence number expected first (vLLM starts at 0); None = accept any.
    first_seq: int | None = 0


class KvBridge:
    """Reads vLLM's KV-event publisher and publishes translated prefixmesh events."""

    def __init__(self, cfg: KvBridgeConfig, translator: BlockTranslator,
                 publish: PublishKv) -> None:
        self.cfg = cfg
        self.translator = translator
        self.publish = publish
        self.seq = SeqTracker(cfg.first_seq)
        # Counters (tests and logs).
        self.batches = 0
        self.replayed = 0
        self.resets = 0
        self.malformed = 0

    async def run(self) -> None:
        """Bridge until cancelled."""
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.cfg.topic.encode())
        sub.connect(self.cfg.endpoint)
        log.info("kv bridge listening on %s (replay %s)", self.cfg.endpoint,
                 self.cfg.replay_endpoint or "none")
        try:
            while True:
                await self.on_message(await sub.recv_multipart(), ctx)
        finally:
            sub.close(linger=0)
            ctx.term()

    async def on_message(self, frames: list[bytes], ctx: zmq.asyncio.Context) -> None:
        """Handle one ``[topic, seq, payload]`` message from the publisher."""
        if len(frames) != 3:
            self.malformed += 1
            log.warning("kv bridge: message of %d frames ignored", len(frames))
            return
        try:
            seq = decode_seq(frames[1])
        except VllmEventError as exc:
            self.malformed += 1
            log.warning("kv bridge: %s", exc)
            return
        if self.seq.is_duplicate(seq):
            return
        gap = self.seq.gap_before(seq)
        if gap is not None:
            await self._recover(gap, ctx)
        self.seq.accept(seq)
        await self._apply(frames[2])

    async def _apply(self, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except VllmEventError as exc:
            # Its events are lost to us, removals possibly among them.
            self.malformed += 1
            log.error("kv bridge: undecodable batch (%s); resetting this worker's cache view",
                      exc)
            await self._reset()
            return
        self.batches += 1
        events = self.translator.translate(batch.events)
        if events:
            await self.publish(events)

    async def _reset(self) -> None:
        self.resets += 1
        await self.publish(self.translator.reset())

    async def _recover(self, gap: SeqGap, ctx: zmq.asyncio.Context) -> None:
        """Apply batches ``gap.start .. gap.end - 1`` from the replay socket, or reset."""
        expected = gap.start
        for seq, payload in await self._replay(gap.start, ctx):
            if seq < expected:
                continue
            if seq != expected or seq >= gap.end:
                break
            await self._apply(payload)
            self.replayed += 1
            expected += 1
        if expected < gap.end:
            log.warning("kv bridge: events %d..%d lost (replayed up to %d); resetting",
                        gap.start, gap.end - 1, expected - 1)
            await self._reset()

    async def _replay(self, start: int, ctx: zmq.asyncio.Context) -> list[tuple[int, bytes]]:
        """Buffered ``(seq, payload)`` from ``start`` on; [] when there is no replay."""
        if not self.cfg.replay_endpoint:
            return []
        import zmq

        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.cfg.replay_endpoint)
        timeout_ms = int(self.cfg.replay_timeout_s * 1000)
        out: list[tuple[int, bytes]] = []
        try:
            # DEALER adds no envelope: the empty delimiter makes vLLM's ROUTER see the
            # [identity, b"", start_seq] it expects.
            await sock.send_multipart([b"", encode_seq(start)])
            while await sock.poll(timeout_ms):
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    break
                seq = decode_seq(frames[1])
                if seq == END_SEQ or not frames[2]:
                    return out
                out.append((seq, frames[2]))
            log.warning("kv bridge: replay from %d incomplete after %d batches", start, len(out))
            return out
        except VllmEventError:
            return out
        finally:
            sock.close(linger=0)
