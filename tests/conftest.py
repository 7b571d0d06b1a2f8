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

REPO = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse a checkout whose request path runs from compiled extensions beside its
    sources (`pip install -e .` without ROUTER_PURE_PYTHON=1): they shadow every edit, so
    the suite would test the code as it was at the install. The compiled build is tested
    from its own tree (`make test-compiled`)."""
    import router.api.errors

    module = Path(router.api.errors.__file__).resolve()
    built_tree = (REPO / ".compiled").exists()  # `make compiled`'s tree: meant to be so
    if (
        not module.name.endswith(".py")
        and module.is_relative_to(REPO / "router")
        and not built_tree
    ):
        raise pytest.UsageError(
            f"{module} is a compiled extension in the checkout: it shadows its source. "
            "Remove the checkout's compiled files (git clean -fX router) and install with "
            "ROUTER_PURE_PYTHON=1 (`make setup` does)."
        )


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
