"""Client keys: what is accepted, what is refused, and what a bad keys file leaves in force."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.api.errors import InvalidApiKey
from router.edge.auth import ClientKeys, KeysFileError, read_keys_file
from router.edge.claims import PriorityClasses, TrafficSettings
from router.http.server.messages import Request


def test_no_keys_means_no_check() -> None:
    assert not ClientKeys().enabled


@pytest.mark.parametrize(
    "header",
    [
        None,
        b"",
        b"Bearer",
        b"Bearer ",
        b"Basic c2VjcmV0LWtleS0x",
        b"secret-key-1",
        b"Bearer secret-key-2",
        b"Bearer secret-key-1x",
        b"Bearer secret-key-",
        b"Bearer \xff\xfe",
    ],
)
def test_a_missing_malformed_or_wrong_key_is_401(header: bytes | None) -> None:
    keys = ClientKeys("secret-key-1")
    with pytest.raises(InvalidApiKey) as caught:
        keys.check(header)
    error = caught.value
    assert (error.status, error.code) == (401, "invalid_api_key")
    assert b"secret-key" not in error.body()
    assert (b"www-authenticate", b'Bearer realm="router"') in error.headers()


@pytest.mark.parametrize(
    "header", [b"Bearer secret-key-1", b"bearer secret-key-1", b"BEARER  secret-key-1 "]
)
def test_the_right_key_passes_whatever_the_scheme_case(header: bytes) -> None:
    assert ClientKeys("secret-key-1").check(header) == "default"


def test_named_keys_give_their_name(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("alice: key-of-alice\nbob: key-of-bob\n")
    keys = ClientKeys(keys_file=str(path))
    assert keys.named
    assert keys.check(b"Bearer key-of-bob") == "bob"
    assert keys.check(b"Bearer key-of-alice") == "alice"


def test_a_reload_takes_new_keys_and_a_bad_file_keeps_the_old(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("alice: key-of-alice\n")
    keys = ClientKeys(keys_file=str(path))
    path.write_text("carol: key-of-carol\n")
    keys.reload()
    assert keys.check(b"Bearer key-of-carol") == "carol"
    with pytest.raises(InvalidApiKey):
        keys.check(b"Bearer key-of-alice")
    path.write_text("carol: [not, a, key]\n")
    with pytest.raises(KeysFileError):
        keys.reload()
    assert keys.check(b"Bearer key-of-carol") == "carol"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "mapping"),
        ("- a\n- b\n", "mapping"),
        ("'bad name!': k1\n", "key name"),
        ("alice: ''\n", "non-empty"),
        ("alice: 'has space'\n", "non-empty"),
        ("alice: same\nbob: same\n", "another name"),
        ("alice: [1]\n", "non-empty"),
    ],
)
def test_a_bad_keys_file_says_what_is_wrong(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(KeysFileError, match=problem) as caught:
        read_keys_file(path)
    assert "same" not in str(caught.value) or problem != "another name"


def test_a_missing_keys_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(KeysFileError, match="keys file"):
        ClientKeys(keys_file=str(tmp_path / "absent.yaml"))


def test_a_keys_file_others_can_read_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("alice: key-of-alice\n")
    path.chmod(0o644)
    ClientKeys(keys_file=str(path))
    assert any("can be read by other users" in record.getMessage() for record in caplog.records)
    caplog.clear()
    path.chmod(0o600)
    ClientKeys(keys_file=str(path))
    assert not caplog.records


def _traffic() -> TrafficSettings:
    return TrafficSettings(classes=PriorityClasses(("interactive", "batch"), "interactive"))


def test_old_and_new_entries_mix_in_one_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(
        "keys:\n"
        "  alice: key-of-alice\n"
        "  nightly:\n"
        "    key: key-of-nightly\n"
        "    priority: batch\n"
        "    max_inflight: 4\n"
        "    max_queued: 20\n"
    )
    keys = ClientKeys(keys_file=str(path), traffic=_traffic())
    assert keys.check(b"Bearer key-of-alice") == "alice"
    assert keys.check(b"Bearer key-of-nightly") == "nightly"
    request = Request("POST", "/v1/chat/completions", [])
    assert keys.grants("alice").claims(request).rank == 0
    nightly = keys.grants("nightly").claims(request)
    assert (nightly.rank, nightly.limits.max_inflight, nightly.limits.max_queued) == (1, 4, 20)
    assert keys.caps_in_force


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("{key: k1, priority: urgent}", "'nightly': 'urgent' is not a priority class"),
        ("{key: k1, prio: batch}", "unknown field"),
        ("{key: k1, weight: many}", "weight must be a whole number"),
        ("{key: k1, priority: [batch]}", "priority must be a string"),
        ("{priority: batch}", "non-empty string"),
        ("{key: k1, tenant_header: authorization}", "lower-case header name"),
    ],
)
def test_an_entry_claiming_what_it_may_not_stops_the_start(
    tmp_path: Path, entry: str, problem: str
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"nightly: {entry}\n")
    with pytest.raises(KeysFileError, match=problem) as caught:
        ClientKeys(keys_file=str(path), traffic=_traffic())
    assert "k1" not in str(caught.value).replace("'nightly'", "")


def test_a_reload_with_a_bad_class_keeps_the_grants_in_force(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("nightly: {key: k1, priority: batch}\n")
    keys = ClientKeys(keys_file=str(path), traffic=_traffic())
    path.write_text("nightly: {key: k1, priority: urgent}\n")
    with pytest.raises(KeysFileError):
        keys.reload()
    assert keys.grants("nightly").claims(Request("POST", "/", [])).rank == 1
    assert not keys.caps_in_force
