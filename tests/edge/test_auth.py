"""Client keys: what is accepted, what is refused, and what a bad keys file leaves in force."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.api.errors import InvalidApiKey
from router.edge.auth import ClientKeys, KeysFileError, read_keys_file


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
