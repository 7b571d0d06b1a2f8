"""The layout the architecture promises: the packages of `router/` import each other only
in the order `router.LAYERS` states, with no circle between packages or between modules; the
two halves of `router/http/` never import each other; `conformance/` never imports
`router`."""

from __future__ import annotations

import ast
from pathlib import Path

import router

REPO = Path(__file__).resolve().parents[1]
HTTP_HALVES = ("router.http.server", "router.http.upstream")


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """Every absolute module a file imports, `TYPE_CHECKING` blocks included. `from
    package import submodule` imports the submodule, as `import package.submodule` does,
    not the package's own `__init__`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found.update(names)
            if not all(_is_module(name) for name in names):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _graph(package: str) -> dict[str, set[str]]:
    files = {_module_name(path): path for path in (REPO / package).rglob("*.py")}
    return {
        name: {dep for dep in _imports(path) if dep in files and dep != name}
        for name, path in files.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def _layer(module: str) -> str | None:
    """The package of `router.LAYERS` a module belongs to; None for `router` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in router.LAYERS) else None


def _package_graph(graph: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The module graph folded to packages `depth` names deep (2: router.fleet)."""

    def package(module: str) -> str:
        return ".".join(module.split(".")[:depth])

    folded: dict[str, set[str]] = {}
    for module, deps in graph.items():
        folded.setdefault(package(module), set()).update(
            package(dep) for dep in deps if package(dep) != package(module)
        )
    return folded


def _against_the_order(graph: dict[str, set[str]]) -> list[str]:
    order = {name: index for index, name in enumerate(router.LAYERS)}
    found = []
    for module, deps in sorted(graph.items()):
        mine = _layer(module)
        for dep in sorted(deps):
            theirs = _layer(dep)
            if mine and theirs and order[theirs] > order[mine]:
                found.append(f"{module} ({mine}) imports {dep} ({theirs})")
    return found


def test_every_package_of_router_has_a_layer() -> None:
    packages = {path.parent.name for path in (REPO / "router").glob("*/__init__.py")}
    assert packages == set(router.LAYERS)


def test_imports_follow_the_layer_order() -> None:
    assert _against_the_order(_graph("router")) == []


def test_the_order_check_finds_an_import_upwards() -> None:
    graph = {"router.fleet.breaker": {"router.pipeline.plan"}, "router.pipeline.plan": set()}
    assert _against_the_order(graph) == [
        "router.fleet.breaker (fleet) imports router.pipeline.plan (pipeline)"
    ]


def test_no_circle_between_packages() -> None:
    graph = _graph("router")
    assert _cycle(_package_graph(graph, 2)) is None
    assert _cycle(_package_graph(graph, 3)) is None


def test_the_halves_of_http_never_import_each_other() -> None:
    crossing = [
        f"{module} imports {dep}"
        for module, deps in _graph("router").items()
        for dep in deps
        for mine, other in (HTTP_HALVES, HTTP_HALVES[::-1])
        if module.startswith(mine) and dep.startswith(other)
    ]
    assert crossing == []


def test_router_has_no_import_circle() -> None:
    assert _cycle(_graph("router")) is None


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_conformance_never_imports_router() -> None:
    offenders = {
        _module_name(path): sorted(
            dep for dep in _imports(path) if dep == "router" or dep.startswith("router.")
        )
        for path in (REPO / "conformance").rglob("*.py")
    }
    assert {name: deps for name, deps in offenders.items() if deps} == {}


def test_from_a_package_importing_a_submodule_depends_on_the_submodule(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text("from router.http import clock\nfrom router.fleet.records import Role\n")
    assert _imports(module) == {
        "router.http.clock",
        "router.fleet.records",
        "router.fleet.records.Role",
    }
