"""A run whose fleet or plane is not installed says so in one line naming what to install,
exits 3 and starts nothing; real engines that do not start end the run in one message,
not a traceback."""

from __future__ import annotations

import re
import stat
import sys
from pathlib import Path
from typing import ClassVar

import pytest

import conformance.environment
from conformance.cli import EXIT_FAILED, EXIT_NOT_INSTALLED, main
from conformance.planes.python import PythonPlane

CASE = "classification/unknown-model-404"


class NotInstalled(PythonPlane):
    """A plane whose interpreter is not there."""

    name = "not-installed"
    interpreter: ClassVar[str] = "/nonexistent/venv/bin/python"
    install_hint: ClassVar[str] = "make not-installed-env"


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def _stderr_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return captured.err.strip().splitlines()


def test_real_engines_without_the_engine_venv(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROUTER_ENGINE_PYTHON", "/nonexistent/python")
    assert main(["run", "--fleet", "vllm", "--plane", "python", "--case", CASE]) == (
        EXIT_NOT_INSTALLED
    )
    assert _stderr_lines(capsys) == [
        "conformance: --fleet vllm: no engine Python at /nonexistent/python "
        "(ROUTER_ENGINE_PYTHON): run `make engine-env`"
    ]


def test_real_engines_over_grpc_without_the_servicer(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The test's own interpreter has vLLM's servicer no more than a fresh engine venv would.
    monkeypatch.setenv("ROUTER_ENGINE_PYTHON", sys.executable)
    monkeypatch.setenv("ROUTER_ENGINE_MODEL", str(_model_dir(tmp_path)))
    assert main(["run", "--fleet", "vllm-grpc", "--plane", "smg", "--case", CASE]) == (
        EXIT_NOT_INSTALLED
    )
    (line,) = _stderr_lines(capsys)
    assert line == (
        f"conformance: --fleet vllm-grpc: the engine Python {sys.executable} has no "
        "smg-grpc-servicer (vLLM's gRPC servicer): run `make engine-env`"
    )


def test_fake_grpc_engines_without_the_grpc_packages(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(conformance.environment, "missing_modules", lambda names: ["grpc"])
    assert main(["run", "--fleet", "grpc", "--plane", "smg", "--case", CASE]) == (
        EXIT_NOT_INSTALLED
    )
    assert _stderr_lines(capsys) == [
        f"conformance: --fleet grpc needs grpcio and smg-grpc-proto in {sys.executable} "
        "(missing: grpc): pip install 'trio-router[grpc]' (make setup installs them)"
    ]


def test_a_plane_that_is_not_installed(capsys: pytest.CaptureFixture[str]) -> None:
    plane = f"{__name__}:NotInstalled"
    assert main(["run", "--plane", plane, "--plane", "python", "--case", CASE]) == (
        EXIT_NOT_INSTALLED
    )
    (line,) = _stderr_lines(capsys)
    assert line.startswith("conformance: plane not-installed is not installed (/nonexistent/")
    assert line.endswith("): make not-installed-env")


def test_engines_that_do_not_start_end_the_run_in_one_message(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'engine: cannot load the model' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("ROUTER_ENGINE_PYTHON", str(broken))
    monkeypatch.setenv("ROUTER_ENGINE_MODEL", str(_model_dir(tmp_path)))
    assert main(["run", "--fleet", "vllm", "--plane", "python", "--case", CASE]) == EXIT_FAILED
    lines = _stderr_lines(capsys)
    # Either engine of the two may be the first to be seen dead.
    assert re.fullmatch(
        r"conformance: the engines did not start: engine[01] exited with 1 before it was healthy:",
        lines[0],
    )
