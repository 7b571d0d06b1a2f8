"""`python -m bench --profile`: what py-spy's collapsed stacks and strace's summary say."""

from __future__ import annotations

from bench.pyspy import summarize, syscalls

STACKS = """\
<module> (router/cli/__main__.py);run (trio/_core/_run.py);handle (router/server/native.py);send_all (router/server/socket.py) 6
<module> (router/cli/__main__.py);run (trio/_core/_run.py);handle (router/server/native.py) 2
<module> (router/cli/__main__.py);run (trio/_core/_run.py);checkpoint (trio/_core/_run.py) 2
garbage line without a count
"""


def test_modules_carry_self_and_inclusive_time() -> None:
    profile = summarize(STACKS)
    assert profile.samples == 10
    modules = {entry.where: entry for entry in profile.by_module}
    assert (
        modules["router/server/socket.py"].self_pct,
        modules["router/server/socket.py"].total_pct,
    ) == (60.0, 60.0)
    assert (
        modules["router/server/native.py"].self_pct,
        modules["router/server/native.py"].total_pct,
    ) == (20.0, 80.0)
    # On every stack, never innermost: inclusive 100, self 0.
    assert (
        modules["router/cli/__main__.py"].self_pct,
        modules["router/cli/__main__.py"].total_pct,
    ) == (0.0, 100.0)
    assert next(entry.where for entry in profile.by_module) == "router/server/socket.py"
    assert "trio/_core/_run.py" not in modules  # our own modules only
    assert profile.by_package == {"router": 80.0, "trio": 20.0}


SUMMARY = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 41.00    0.010000           3      3000           sendto
 30.00    0.008000           2      4500      1500 recvfrom
 29.00    0.007000           2      3000           epoll_ctl
------ ----------- ----------- --------- --------- ----------------
100.00    0.025000           2     10500      1500 total
"""


def test_system_calls_per_request_with_the_failed_ones() -> None:
    calls = {call.name: call for call in syscalls(SUMMARY, requests=1500)}
    assert set(calls) == {"sendto", "recvfrom", "epoll_ctl"}  # no header, rule or total
    assert calls["recvfrom"].per_request == 3.0 and calls["recvfrom"].errors == 1500
    assert calls["sendto"].per_request == 2.0 and calls["sendto"].errors == 0
    assert next(call.name for call in syscalls(SUMMARY, 1500)) == "recvfrom"
    assert all(call.per_request == 0.0 for call in syscalls(SUMMARY, requests=0))
