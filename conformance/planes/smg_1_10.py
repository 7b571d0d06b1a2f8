"""The SGLang Model Gateway at release 1.10.0, from a venv of its own (`make smg-1.10-env`,
`.venv-smg-1.10`): the release before its gRPC path answered 503 for a model whose
workers are all unavailable (smg PR #2465, in 1.11.0 and later). Kept beside the current
`smg` plane so that a run shows the suite catching that bug where it lived: the
classification cases on `--fleet grpc` fail here with 404 model_not_found and pass on
`smg`.

Run by name (`--plane smg-1.10`); `--plane all` leaves it out. The flags are the current
plane's (every one exists in 1.10.0's `smg launch --help`); only the interpreter differs.
Only its gRPC path is recorded (`smg_1_10_grpc_divergences.yaml`): on the HTTP fleet no
divergence is listed, so every difference there is reported as a plain failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from conformance.planes.smg import SmgPlane

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-smg-1.10"


class Smg110Plane(SmgPlane):
    name = "smg-1.10"
    divergences: ClassVar[Path | None] = None
    grpc_divergences: ClassVar[Path | None] = Path(__file__).with_name(
        "smg_1_10_grpc_divergences.yaml"
    )
    interpreter: ClassVar[str] = str(VENV / "bin" / "python")
    command_prefix: ClassVar[tuple[str, ...]] = (interpreter, "-m", "smg", "launch")
    install_hint: ClassVar[str] = "make smg-1.10-env (a venv of its own, .venv-smg-1.10)"
