"""The environment transformers renders chat templates in (`render_jinja_template`):
jinja2's immutable sandbox with `trim_blocks`, `lstrip_blocks`, the loop controls,
transformers' `{% generation %}` block, `raise_exception`, `strftime_now` and a `tojson`
that does not escape HTML. Here every item and attribute read and every call the template
makes also spends one operation of an `OperationBudget`, so a render on a client's
messages stops at a fixed cost."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2
    import jinja2.nodes
    import jinja2.parser


class OutOfOperations(Exception):
    """The template ran past its operation budget."""


class OperationBudget:
    """The operations the render under way may still spend; whoever renders sets
    `remaining` first."""

    __slots__ = ("remaining",)

    def __init__(self) -> None:
        self.remaining = 0

    def spend(self) -> None:
        self.remaining -= 1
        if self.remaining < 0:
            raise OutOfOperations("the template ran past its operation budget")


@functools.cache
def sandbox() -> tuple[jinja2.Environment, OperationBudget]:
    """The environment, and the budget it spends (one of each per process: renders run
    one at a time, in the router's one trio thread). jinja2 is imported here: it is an
    optional dependency (the `kv` extra), needed only with a model directory; ValueError
    when it is not installed."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.parser
        import jinja2.sandbox
    except ModuleNotFoundError:
        raise ValueError("needs the `jinja2` package (pip install jinja2)") from None

    budget = OperationBudget()

    class Generation(jinja2.ext.Extension):
        """transformers' `{% generation %}` block (it marks the assistant's tokens for
        training masks); its body renders as it is."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
        def getitem(self, obj: Any, argument: Any) -> Any:
            budget.spend()
            return super().getitem(obj, argument)

        def getattr(self, obj: Any, attribute: str) -> Any:
            budget.spend()
            return super().getattr(obj, attribute)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            budget.spend()
            return super().call(__context, __obj, *args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env, budget
