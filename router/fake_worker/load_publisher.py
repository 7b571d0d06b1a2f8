"""The fake worker's pushed load, as SGLang's `--load-publish-endpoint` sends it.

SGLang's framing (`router.engines.load_readings` reads it): one PUB socket per DP rank,
rank r bound at `base + r`, each message `(b"load", seq, payload)` with `seq` an 8-byte
big-endian count from 0 and `payload` a msgpack tagged array `["LoadStat", running,
waiting, kv_tokens, kv_capacity, rank]`. A changed reading goes out at once (checked every
`CHECK_S`), an unchanged one again after `HEARTBEAT_S`, as SGLang's publisher does. The
reading is what the gauges show (`FakeWorker.gauge_loads`: with `--gauge-step-ms` the
step before, with `--external-load` another sender's requests too).

The ports are consecutive, as the advertisement (`/server_info`'s `kv_events` block
holds one base) requires: a base the kernel would pick is tried, and another one while
any of its ranks' ports is taken.
"""

from __future__ import annotations

import random
import socket

import msgspec
import trio
import zmq

from router.fake_worker.engine import FakeWorker
from router.fake_worker.info import CONTEXT_LENGTH, capacity

HEARTBEAT_S = 1.0
CHECK_S = 0.02
BIND_TRIES = 50
TOPIC = b"load"


def _bind_consecutive(
    context: zmq.Context[zmq.Socket[bytes]], host: str, count: int, rng: random.Random
) -> tuple[int, list[zmq.Socket[bytes]]]:
    """`count` PUB sockets on consecutive ports of `host`; OSError when none was found."""
    for _ in range(BIND_TRIES):
        base = rng.randrange(20000, 60000 - count)
        sockets: list[zmq.Socket[bytes]] = []
        try:
            for rank in range(count):
                pub = context.socket(zmq.PUB)
                sockets.append(pub)
                pub.setsockopt(zmq.LINGER, 0)
                pub.bind(f"tcp://{host}:{base + rank}")
        except zmq.ZMQError:
            for pub in sockets:
                pub.close(linger=0)
            continue
        return base, sockets
    raise OSError(f"no {count} consecutive free ports for the load publishers on {host}")


async def serve_load_publisher(
    worker: FakeWorker, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Publish `worker`'s load until cancelled; reports the first port (rank r publishes
    at base + r) and sets `worker.load_port_base`. Cancellation: the sockets close."""
    settings = worker.settings
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    # A free-port hint from the kernel seeds the search, so parallel fakes rarely collide.
    with socket.socket() as probe:
        probe.bind((settings.host, 0))
        hint = probe.getsockname()[1]
    base, sockets = _bind_consecutive(context, host, settings.dp_size, random.Random(hint))
    encoder = msgspec.msgpack.Encoder()
    kv_capacity = capacity(settings) * CONTEXT_LENGTH
    try:
        worker.load_port_base = base
        task_status.started(base)
        seq = 0
        sent: list[tuple[int, int] | None] = [None] * len(sockets)
        sent_at = [0.0] * len(sockets)
        while True:
            now = trio.current_time()
            for rank, (pub, load) in enumerate(zip(sockets, worker.gauge_loads(), strict=True)):
                counts = (load.running, load.queued)
                if counts == sent[rank] and now - sent_at[rank] < HEARTBEAT_S:
                    continue
                used = min(kv_capacity, load.running * CONTEXT_LENGTH)
                payload = encoder.encode(
                    ["LoadStat", load.running, load.queued, used, kv_capacity, rank]
                )
                pub.send_multipart((TOPIC, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
                seq += 1
                sent[rank], sent_at[rank] = counts, now
            await trio.sleep(CHECK_S)
    finally:
        worker.load_port_base = None
        for pub in sockets:
            pub.close(linger=0)
