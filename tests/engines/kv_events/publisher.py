"""A real in-process ZMQ publisher framed as vLLM's `ZmqEventPublisher`, for tests.

It sends `(topic, seq as 8 bytes big-endian, payload)` on a PUB-compatible socket,
keeps every payload in a bounded buffer, and serves the replay ROUTER protocol from it
(`[identity, b"", start_seq]` in; every buffered `(topic, seq, payload)` with seq >=
start, then the `-1` end marker with an empty topic and payload, out, as vLLM 0.32
frames them; with `replay_topic=False` without the topic frame, as earlier releases).

The PUB socket is an XPUB: on the wire it is a PUB, but it also reports each
subscription as it reaches the publisher, so a test can wait for the subscriber to be
live instead of sleeping through ZMQ's slow-joiner window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import zmq

from router.engines.zmq_trio import close_socket, recv_multipart, socket_fd

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _endpoint(sock: zmq.Socket[bytes]) -> str:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


class TestPublisher:
    __test__ = False  # not a pytest class

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        buffer_steps: int,
        topic: bytes,
        replay_topic: bool = True,
    ):
        self.context = context
        self.topic = topic
        self.replay_topic = replay_topic
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0
        self.replay_requests: list[int] = []
        self.replay_enabled = True
        self.replay_wanted = trio.Event()
        self.subscribed = 0
        self._subscription_changed = trio.Event()
        self._resumed = trio.Event()
        self.pub = self._bind_pub("tcp://127.0.0.1:*")
        self.endpoint = _endpoint(self.pub)
        self.replay = context.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = _endpoint(self.replay)

    def _bind_pub(self, endpoint: str) -> zmq.Socket[bytes]:
        pub = self.context.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        try:
            pub.bind(endpoint)
        except BaseException:
            pub.close(linger=0)
            raise
        return pub

    def cut(self) -> None:
        """Drop the PUB side (subscribers see their connection go); `resume` rebinds the
        same port, and ZMQ reconnects them."""
        close_socket(self.pub)
        self.subscribed = 0
        self._resumed = trio.Event()

    async def resume(self) -> None:
        while True:
            try:
                self.pub = self._bind_pub(self.endpoint)
                break
            except zmq.ZMQError as exc:
                # ZMQ closes the old listener in its I/O thread, a moment after close().
                if exc.errno != zmq.EADDRINUSE:
                    raise
                await trio.sleep(0.01)
        self._resumed.set()

    def publish(self, payload: bytes, *, live: bool = True) -> int:
        """Buffer a batch and (unless `live=False`, a message lost on the wire) send it."""
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        if live:
            self.send_raw([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def restart(self) -> None:
        """What an engine restart looks like on the wire: a new sequence, an empty buffer."""
        self.next_seq = 0
        self.buffer.clear()

    async def wait_subscribed(self, count: int = 1) -> None:
        """Until `count` subscriptions have reached the publisher in total."""
        while self.subscribed < count:
            await self._subscription_changed.wait()

    async def wait_unsubscribed(self) -> None:
        while self.subscribed > 0:
            await self._subscription_changed.wait()

    async def serve_subscriptions(self) -> None:
        while True:
            try:
                (message,) = await recv_multipart(self.pub, socket_fd(self.pub))
            except (trio.ClosedResourceError, zmq.ZMQError):
                await self._resumed.wait()  # cut: wait for the new socket
                continue
            if message[:1] == b"\x01":
                self.subscribed += 1
            elif message[:1] == b"\x00":
                self.subscribed -= 1
            self._subscription_changed.set()
            self._subscription_changed = trio.Event()

    async def serve_replay(self) -> None:
        while True:
            frames = await recv_multipart(self.replay, socket_fd(self.replay))
            identity, empty, start = frames
            assert empty == b"" and len(start) == 8
            self.replay_requests.append(int.from_bytes(start, "big"))
            self.replay_wanted.set()
            if not self.replay_enabled:
                continue  # a publisher that does not answer
            topic = [self.topic] if self.replay_topic else []
            for seq, payload in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    self.replay.send_multipart(
                        [identity, b"", *topic, seq.to_bytes(8, "big"), payload]
                    )
            self.replay.send_multipart([identity, b"", *([b""] if topic else []), END_SEQ, b""])

    def close(self) -> None:
        close_socket(self.pub)
        close_socket(self.replay)


@asynccontextmanager
async def open_test_publisher(
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    *,
    buffer_steps: int = 10_000,
    topic: bytes = b"",
    replay_topic: bool = True,
) -> AsyncIterator[TestPublisher]:
    publisher = TestPublisher(context or zmq.Context.instance(), buffer_steps, topic, replay_topic)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.serve_subscriptions)
            nursery.start_soon(publisher.serve_replay)
            yield publisher
            nursery.cancel_scope.cancel()
    finally:
        publisher.close()
