"""`open_process` leaves nothing of its child's group alive once its block is left."""

from __future__ import annotations

import os
import re
import sys

import trio

from conformance.processes import live_group_members, open_process

# Forks a grandchild that holds 256 MB (so that dying, returning its pages, takes it a
# while) and sleeps; says so once the grandchild holds them. Only the group's SIGKILL
# after the parent's end can stop the grandchild.
GRANDCHILD = "import sys, time; held = b'x' * (256 << 20); print(flush=True); time.sleep(600)"
LEAVES_A_GRANDCHILD = f"""
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", {GRANDCHILD!r}], stdout=subprocess.PIPE)
grandchild.stdout.readline()
print("forked", flush=True)
time.sleep(600)
"""


def test_a_groups_live_members_are_found_and_zombies_are_not() -> None:
    assert os.getpid() in live_group_members(os.getpgid(0))
    assert live_group_members(2**22 + 12345) == []  # no such group


async def test_no_member_of_the_group_is_alive_once_the_block_is_left() -> None:
    with trio.fail_after(30):
        for _ in range(5):
            async with open_process(
                [sys.executable, "-c", LEAVES_A_GRANDCHILD], "parent", stop_grace_s=0
            ) as child:
                await child.output.wait_for(re.compile("forked"))
                group = child.process.pid
                assert len(live_group_members(group)) == 2
            assert live_group_members(group) == []
