"""Fixtures shared across the suite."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import zmq
from hypothesis import settings

from tests.support.etcd_server import EtcdServer, etcd_available, open_etcd_server

# `make test` plays every property test's examples from a fixed seed (`--hypothesis-profile
# suite`), so a CI run fails or passes the same way each time; `make fuzz` and a bare
# `pytest` draw new examples on every run.
settings.register_profile("suite", derandomize=True)


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    """A real etcd on free loopback ports with its own data dir, stopped afterwards.

    `make test` installs Debian's etcd-server when it is missing; a run without it fails
    here rather than skipping the discovery tests.
    """
    assert etcd_available(), (
        "no etcd binary on PATH: run `make system-deps` (apt-get install -y etcd-server)"
    )
    async with open_etcd_server(tmp_path / "etcd") as server:
        yield server


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A ZMQ context of the test's own, destroyed (linger 0) afterwards."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)
