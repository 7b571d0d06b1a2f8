from __future__ import annotations

import pytest

from router.http.backoff import Backoff


def test_delays_double_up_to_the_cap_and_reset_after_a_success() -> None:
    backoff = Backoff(0.1, 5.0)
    delays = [backoff.failure() for _ in range(9)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0])
    backoff.reset()
    assert backoff.failure() == 0.1
    assert backoff.failure() == 0.2


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(0, 5)
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(6, 5)
