"""The fake worker's KV-cache events: what its prefix cache does, published as vLLM does.

vLLM's `ZmqEventPublisher` framing (`router.engines.kv_events.subscription` describes the
consumer's side): a PUB socket sends `(topic, seq, payload)` per batch, `seq` an 8-byte
big-endian count from 0 for the process; `payload` a msgpack `KVEventBatch` in the
current map form, `{"ts", "events", "data_parallel_rank"}` with each event a map tagged
by `type` (`BlockStored` with `block_hashes`, `parent_block_hash`, `token_ids`,
`block_size`, `lora_id`, `medium`, `lora_name`; `BlockRemoved`; `AllBlocksCleared`).
A ROUTER socket answers a replay request `(identity, b"", start_seq)` with every
buffered batch from `start_seq` as `(identity, b"", topic, seq, payload)`, then the end
marker `(identity, b"", b"", seq -1, b"")`, as vLLM 0.32 does.

One batch per prefix-cache change (a request's new blocks, its evictions, a flush),
sent at once from the request's own task: no queue, so a batch is on the wire before
the response that caused it. A PUB send never blocks (ZMQ drops beyond its high-water
mark, which a subscriber sees as a gap and replays).

Block hashes are the prefix cache's own keys: Python's `hash` chained over each block,
seeded per process as vLLM's are, so the router can never use them as keys.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import trio
import zmq

from router.engines.zmq_trio import recv_multipart, socket_fd
from router.fake_worker.prefix_cache import BLOCK_TOKENS, PrefixCache, block_token_ids
from router.fake_worker.settings import KvPublisherSettings

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KvEventPublisher:
    """A prefix cache's `CacheListener` that publishes each change as one batch."""

    def __init__(
        self, settings: KvPublisherSettings, context: zmq.Context[zmq.Socket[bytes]] | None = None
    ) -> None:
        self.settings = settings
        self._context = context or zmq.Context.instance()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self.next_seq = 0
        self.published = 0
        self.replays = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._lora_ids: dict[str, int] = {}
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self.endpoint = settings.endpoint
        self.replay_endpoint = settings.replay_endpoint

    # -- CacheListener -----------------------------------------------------------------

    def stored(
        self,
        parent: int | None,
        keys: Sequence[int],
        blocks: Sequence[object],
        lora_name: str | None = None,
    ) -> None:
        tokens: list[int] = []
        for block in blocks:
            tokens.extend(block_token_ids(block))
        self._publish(
            {
                "type": "BlockStored",
                "block_hashes": list(keys),
                "parent_block_hash": parent,
                "token_ids": tokens,
                "block_size": BLOCK_TOKENS,
                "lora_id": None if lora_name is None else self._lora_id(lora_name),
                "medium": "GPU",
                "lora_name": lora_name,
            }
        )

    def _lora_id(self, lora_name: str) -> int:
        """vLLM's numeric id of an adapter: 1, 2, ... in the order it first met them."""
        return self._lora_ids.setdefault(lora_name, len(self._lora_ids) + 1)

    def removed(self, keys: Sequence[int]) -> None:
        self._publish({"type": "BlockRemoved", "block_hashes": list(keys), "medium": "GPU"})

    def cleared(self) -> None:
        self._publish({"type": "AllBlocksCleared"})

    # -- publishing --------------------------------------------------------------------

    def _publish(self, event: dict[str, Any]) -> None:
        payload = self._encoder.encode(
            {
                "ts": time.time(),  # wall-clock: vLLM stamps a batch in epoch seconds
                "events": [event],
                "data_parallel_rank": self.settings.dp_rank,
            }
        )
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        if self._pub is not None:
            try:
                self._pub.send_multipart(
                    [self.settings.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK
                )
            except zmq.Again:
                pass  # beyond the high-water mark: the subscriber sees a gap and replays
        self.published += 1

    def restart(self) -> None:
        """What an engine restart looks like on the wire: the sequence starts again at 0
        and the replay buffer is empty (the cache itself is the caller's to clear)."""
        self.next_seq = 0
        self.buffer.clear()

    def bind(self) -> None:
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.settings.endpoint)
        self._pub = pub
        self.endpoint = _bound(pub)
        if self.settings.replay_endpoint is not None:
            replay = self._context.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self.settings.replay_endpoint)
            self._replay = replay
            self.replay_endpoint = _bound(replay)

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                trio.lowlevel.notify_closing(socket_fd(sock))
                sock.close(linger=0)
        self._pub = self._replay = None

    async def serve_replay(self) -> None:
        sock = self._replay
        if sock is None:
            await trio.sleep_forever()
            return
        fd = socket_fd(sock)
        while True:
            frames = await recv_multipart(sock, fd)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # not a replay request: vLLM ignores it too
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            self.replays += 1
            topic = self.settings.topic
            for seq, payload in list(self.buffer):
                if seq >= start:
                    sock.send_multipart([identity, b"", topic, seq.to_bytes(8, "big"), payload])
            sock.send_multipart([identity, b"", b"", END_OF_REPLAY, b""])


async def serve_kv_publisher(
    cache: PrefixCache,
    publisher: KvEventPublisher,
    *,
    task_status: trio.TaskStatus[KvEventPublisher] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish `cache`'s changes until cancelled. Reports the publisher, bound (its
    `endpoint` and `replay_endpoint` are the bound addresses), once it is listening.

    Cancellation: both sockets close (linger 0) and the cache stops reporting.
    """
    publisher.bind()
    cache.listener = publisher
    try:
        task_status.started(publisher)
        await publisher.serve_replay()
    finally:
        cache.listener = None
        publisher.close()


# pyzmq under trio, as in `router.engines.kv_events.subscription`: ZMQ_FD is edge-triggered, so
# ZMQ_EVENTS is checked (and every ready message taken) before each wait on it.


def _bound(sock: zmq.Socket[bytes]) -> str:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()
