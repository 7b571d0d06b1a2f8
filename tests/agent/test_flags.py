"""The registration and drain flags mean the same in `router agent` and `router fake-worker`."""

from __future__ import annotations

import pytest

from router.agent.cli import build_parser as agent_parser
from router.agent.cli import options_from_args
from router.agent.drain import DrainSettings
from router.fake_worker.cli import parse_command

SHARED = [
    "--etcd-prefix",
    "/fleet/a/",
    "--advertise-host",
    "10.0.0.7",
    "--worker-id",
    "w-7",
    "--lease-ttl-s",
    "9",
    "--drain-settle-s",
    "2.5",
    "--drain-timeout-s",
    "40",
    "--drain-poll-s",
    "0.25",
]
AGENT = ["--engine-url", "http://127.0.0.1:30000", "--model", "m"]


def test_both_commands_read_the_shared_flags_alike() -> None:
    agent = options_from_args(agent_parser().parse_args([*AGENT, *SHARED]))
    _, registration = parse_command(["--register", "etcd://127.0.0.1:2379", *SHARED])
    assert registration is not None
    fake = registration.flags
    expected_drain = DrainSettings(poll_interval_s=0.25, settle_s=2.5, timeout_s=40.0)
    assert (agent.etcd_prefix, agent.lease_ttl_s, agent.drain) == ("/fleet/a/", 9, expected_drain)
    assert (fake.etcd_prefix, fake.lease_ttl_s, fake.drain) == ("/fleet/a/", 9, expected_drain)
    assert agent.advertise_host == fake.advertise_host == "10.0.0.7"
    assert agent.record.id == fake.worker_id == "w-7"


def test_without_register_the_fake_worker_has_no_registration() -> None:
    settings, registration = parse_command(["--model", "m"])
    assert registration is None
    assert settings.model == "m"


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--lease-ttl-s", "0"),
        ("--drain-poll-s", "0"),
        ("--drain-settle-s", "-1"),
        ("--drain-timeout-s", "0"),
    ],
)
def test_both_commands_refuse_a_bad_shared_flag_by_its_name(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=f"^{flag} must be"):
        options_from_args(agent_parser().parse_args([*AGENT, flag, value]))
    with pytest.raises(SystemExit) as fake_exit:
        parse_command(["--register", "etcd://127.0.0.1:2379", flag, value])
    assert fake_exit.value.code == 2
    assert f"error: {flag} must be" in capsys.readouterr().err
