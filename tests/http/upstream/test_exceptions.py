"""Which connect failures are the router's own shortage, wherever trio wraps the errno."""

from __future__ import annotations

import errno

import pytest

from router.http.upstream.exceptions import local_errno_kind


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (errno.EMFILE, "emfile"),
        (errno.ENFILE, "enfile"),
        (errno.ENOBUFS, "enobufs"),
        (errno.EADDRNOTAVAIL, "eaddrnotavail"),
    ],
)
def test_local_errnos_are_named(code: int, kind: str) -> None:
    assert local_errno_kind(OSError(code, "x")) == kind


@pytest.mark.parametrize(
    "code", [errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ETIMEDOUT, errno.ECONNRESET, None]
)
def test_a_worker_side_failure_is_no_local_shortage(code: int | None) -> None:
    assert local_errno_kind(OSError(code, "x") if code else OSError("no errno")) is None


def test_the_errno_is_found_behind_trio_s_wrapping() -> None:
    # trio reports failed attempts as an OSError without errno caused by a group.
    group = ExceptionGroup(
        "attempts", [OSError(errno.ECONNREFUSED, "a"), OSError(errno.EMFILE, "b")]
    )
    wrapped = OSError("all attempts to connect failed")
    wrapped.__cause__ = group
    assert local_errno_kind(wrapped) == "emfile"


def test_a_cycle_of_causes_ends() -> None:
    first, second = OSError("a"), OSError("b")
    first.__cause__, second.__context__ = second, first
    assert local_errno_kind(first) is None
