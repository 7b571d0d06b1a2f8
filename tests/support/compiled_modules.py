"""The modules `setup.py` compiles, read from its `COMPILED` list without running the build."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def compiled_modules() -> list[Path]:
    source = (REPO / "setup.py").read_text().split("\nsetup(")[0]  # not the build itself
    namespace: dict[str, object] = {"__file__": str(REPO / "setup.py"), "__name__": "setup"}
    exec(compile(source, "setup.py", "exec"), namespace)
    listed = namespace["compiled_modules"]
    assert callable(listed)
    return [REPO / relative for relative in listed()]
