"""The compiled modules' module-level constants are `Final`: compiled, a `Final` name is
read from a C static, any other from the module's globals dict at every use (a unary
request made 126 such lookups; docs/performance.md, "fifth round")."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.compiled_modules import REPO, compiled_modules

TYPE_FACTORIES = {"TypeVar", "NewType", "ParamSpec"}


def _is_type_alias(value: ast.expr) -> bool:
    """`Headers = list[...]`, `X = A | B`, `T = TypeVar(...)`, `Alias = SomeClass`: types,
    which `Final` would stop being."""
    if isinstance(value, ast.Subscript):
        return True
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.BitOr):
        return True
    if isinstance(value, ast.Call):
        function = value.func
        name = function.id if isinstance(function, ast.Name) else getattr(function, "attr", "")
        return name in TYPE_FACTORIES
    return isinstance(value, ast.Name) and value.id[:1].isupper() and not value.id.isupper()


def _constants_not_final(path: Path, root: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text())
    rebound = {
        name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names
    }
    bindings: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        bindings[name.id] = bindings.get(name.id, 0) + 1
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            bindings[node.target.id] = bindings.get(node.target.id, 0) + 1
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, (ast.Tuple, ast.List)) for target in node.targets
        ):
            # `A, B = range(2)` cannot be Final: one name per line.
            found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node.targets[0])}")
            continue
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value, annotation = node.targets[0], node.value, None
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value, annotation = node.target, node.value, node.annotation
        else:
            continue
        if not isinstance(target, ast.Name) or target.id.startswith("__"):
            continue
        if target.id in rebound or bindings.get(target.id, 0) != 1:
            continue  # state the module rebinds: not a constant
        if annotation is not None:
            if "Final" not in ast.unparse(annotation) and "TypeAlias" not in ast.unparse(
                annotation
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno} {target.id}")
        elif not _is_type_alias(value):
            found.append(f"{path.relative_to(root)}:{node.lineno} {target.id}")
    return found


def test_the_compiled_modules_are_found() -> None:
    names = {path.name for path in compiled_modules()}
    assert {"direct_socket.py", "clock.py", "dispatch.py"} <= names


def test_every_module_level_constant_of_a_compiled_module_is_final() -> None:
    assert [name for path in compiled_modules() for name in _constants_not_final(path)] == []


def test_the_check_finds_a_constant_that_is_not_final(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text(
        "from typing import Final\n"
        "A = 1\n"
        "B: Final = 2\n"
        "C: dict[str, int] = {}\n"
        "D: Final[dict[str, int]] = {}\n"
        "Headers = list[tuple[bytes, bytes]]\n"
        "E = 0\n"
        "E = 1\n"
        "F, G = range(2)\n"
    )
    assert _constants_not_final(module, tmp_path) == [
        "module.py:2 A",
        "module.py:4 C",
        "module.py:9 (F, G)",
    ]
