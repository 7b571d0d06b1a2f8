"""DirectSocket's receive: a peer that sends at its own pace costs no failed `recv` per read
once a read had to wait; a peer that keeps the buffer full is read without waiting."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from router.http.direct_socket import DirectSocket


class CountingSocket(socket.socket):
    """A stdlib socket that counts its `recv` calls and the ones that found nothing."""

    recvs = 0
    would_block = 0

    def recv(self, size: int, flags: int = 0) -> bytes:
        type(self).recvs += 1
        try:
            return super().recv(size, flags)
        except BlockingIOError:
            type(self).would_block += 1
            raise


def pair() -> tuple[DirectSocket, socket.socket]:
    ours, theirs = socket.socketpair()
    counted = CountingSocket(ours.family, ours.type, ours.proto, fileno=ours.detach())
    CountingSocket.recvs = CountingSocket.would_block = 0
    return DirectSocket(counted), theirs


def test_paced_bytes_cost_one_recv_each_after_the_first_wait() -> None:
    async def main() -> None:
        reader, peer = pair()
        events = [b"data: %d\n\n" % n for n in range(20)]
        got: list[bytes] = []

        async def read() -> None:
            for _ in events:
                got.append(await reader.receive_some())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            for event in events:
                await trio.testing.wait_all_tasks_blocked()  # the reader waits first
                peer.send(event)
        assert got == events
        # Only the first read tried a recv before waiting; every later one waited first.
        assert CountingSocket.would_block == 1
        assert CountingSocket.recvs == len(events) + 1
        peer.close()
        reader.close()

    trio.run(main)


def test_a_full_buffer_means_the_next_read_does_not_wait() -> None:
    async def main() -> None:
        reader, peer = pair()
        async with trio.open_nursery() as nursery:

            async def first_read() -> None:
                assert await reader.receive_some(4) == b"abcd"

            nursery.start_soon(first_read)
            await trio.testing.wait_all_tasks_blocked()
            peer.send(b"abcdefgh")
        blocked_before = CountingSocket.would_block
        # The last read filled its 4 bytes: more is probably there, so no wait first.
        assert await reader.receive_some(4) == b"efgh"
        assert CountingSocket.would_block == blocked_before
        peer.close()
        assert await reader.receive_some(4) == b""
        reader.close()

    trio.run(main)


def test_a_cancelled_read_consumes_nothing_whether_or_not_it_waits_first() -> None:
    async def main() -> None:
        reader, peer = pair()
        async with trio.open_nursery() as nursery:

            async def first_read() -> None:
                assert await reader.receive_some() == b"a"

            nursery.start_soon(first_read)
            await trio.testing.wait_all_tasks_blocked()
            peer.send(b"a")
        # That read waited and took less than it asked for: the next one waits first.
        peer.send(b"bc")
        with trio.CancelScope() as scope:
            scope.cancel()
            await reader.receive_some()
        assert scope.cancelled_caught
        assert await reader.receive_some() == b"bc"
        peer.close()
        reader.close()

    trio.run(main)


def test_a_read_that_waits_first_is_its_own_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """A paced read costs one trip through the scheduler (its wait), no separate check
    for cancellation before it."""
    checks = 0
    check = trio.lowlevel.checkpoint_if_cancelled

    async def counted() -> None:
        nonlocal checks
        checks += 1
        await check()

    monkeypatch.setattr(trio.lowlevel, "checkpoint_if_cancelled", counted)

    async def main() -> None:
        reader, peer = pair()
        events = [b"data: %d\n\n" % n for n in range(20)]

        async def read() -> None:
            for event in events:
                assert await reader.receive_some() == event

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            for event in events:
                await trio.testing.wait_all_tasks_blocked()
                peer.send(event)
        # The first read tried its recv before waiting; the other 19 waited first.
        assert checks == 1
        peer.close()
        reader.close()

    trio.run(main)
