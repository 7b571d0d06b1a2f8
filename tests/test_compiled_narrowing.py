"""No compiled coroutine tests an attribute's type again after an `await` in the same body.

mypy narrows `self.x` after `if self.x is not None: raise ...` and keeps the narrowing
across an `await`, where another task may set the attribute. Pure Python reads the new
value; the compiled build casts it to the narrowed type and raises TypeError ("None object
expected"). A client's reset reached `ConnectionReader.receive` this way. Such a second
test belongs in a method of its own, which reads the attribute afresh.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.compiled_modules import REPO, compiled_modules


def _attribute(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


def _narrowed(test: ast.expr) -> set[str]:
    """The attributes a condition narrows by type: `is`/`is not` and `isinstance`."""
    found = set()
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.Is, ast.IsNot)):
            name = _attribute(node.left)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
        ):
            name = _attribute(node.args[0])
        else:
            continue
        if name is not None:
            found.add(name)
    return found


def _retested_after_await(path: Path, root: Path = REPO) -> list[str]:
    found = []
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, ast.AsyncFunctionDef):
            continue
        tests: list[tuple[int, str]] = []
        awaits: list[int] = []
        for node in ast.walk(function):
            if isinstance(node, (ast.If, ast.While, ast.Assert, ast.IfExp)):
                tests.extend((node.lineno, name) for name in _narrowed(node.test))
            elif isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)):
                awaits.append(node.lineno)
        for line, name in sorted(set(tests)):
            earlier = [first for first, same in tests if same == name and first < line]
            if earlier and any(min(earlier) < wait < line for wait in awaits):
                found.append(f"{path.relative_to(root)}:{line} {name}")
    return found


def test_no_compiled_coroutine_retests_an_attribute_after_an_await() -> None:
    assert [name for path in compiled_modules() for name in _retested_after_await(path)] == []


def test_the_check_finds_a_test_repeated_across_an_await(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text(
        "class Reader:\n"
        "    async def receive(self):\n"
        "        if self.broken is not None:\n"
        "            raise ValueError\n"
        "        await self.wait()\n"
        "        if self.broken is not None:\n"  # line 6: found
        "            raise ValueError\n"
        "        if isinstance(self.other, int):\n"
        "            pass\n"
        "        if self.count == 2:\n"
        "            await self.wait()\n"
        "        if self.count == 3:\n"  # not a type test: not found
        "            pass\n"
        "        assert isinstance(self.other, int)\n"  # line 14: found
        "\n"
        "    async def separate(self):\n"
        "        if self.broken is not None:\n"
        "            raise ValueError\n"
        "        self.check()\n"  # no await between: not found
        "        if self.broken is not None:\n"
        "            raise ValueError\n"
    )
    assert _retested_after_await(module, tmp_path) == [
        "module.py:6 self.broken",
        "module.py:14 self.other",
    ]
