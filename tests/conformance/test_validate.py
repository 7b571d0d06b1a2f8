"""`conformance validate` names the file, the line and the field of what is wrong."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.loader import load_case
from conformance.model import SendStep
from tests.conformance.stub_planes import StubPlane

GOOD = """\
name: a good case
description: two workers, one request
fleet:
  a: {}
  b: {}
steps:
  - send: {count: 2}
    expect:
      status: {200: 2}
      dispatches: {a: 1, b: [0, 1]}
"""


def write(tmp_path: Path, text: str, name: str = "case.yaml") -> Path:
    path = tmp_path / "breaker" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["--spec", str(tmp_path), "validate"])
    return code, capsys.readouterr().err


def test_a_good_case_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, GOOD)
    code, err = validate(tmp_path, capsys)
    assert (code, err) == (0, "")
    case = load_case(path, tmp_path)
    assert case.id == "breaker/case"
    assert [w.name for w in case.fleet] == ["a", "b"]


@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        # A typo in a field name, with a suggestion.
        (
            GOOD.replace("  a: {}", "  a:\n    behavior: {fail_first: 1}"),
            5,
            "fleet.a.behavior",
            "did you mean 'behaviour'",
        ),
        # A wrong type, reported at the value's own line.
        (GOOD.replace("count: 2", "count: two"), 7, "steps[0].send.count", "must be an integer"),
        # A worker the fleet does not have.
        (GOOD.replace("b: [0, 1]", "c: 1"), 10, "steps[0].expect.dispatches.c", "no worker 'c'"),
        # A range upside down.
        (
            GOOD.replace("[0, 1]", "[3, 1]"),
            10,
            "steps[0].expect.dispatches.b",
            "max 1 is below min 3",
        ),
        # Not an HTTP status.
        (GOOD.replace("{200: 2}", "{ok: 2}"), 9, "steps[0].expect.status.ok", "HTTP status"),
        # A required field missing: reported at the mapping that lacks it.
        (
            GOOD.replace("description: two workers, one request\n", ""),
            1,
            "description",
            "is required",
        ),
        # The same key twice.
        (GOOD.replace("  b: {}", "  b: {}\n  a: {}"), 6, "fleet.a", "given twice"),
        # A behaviour value out of range.
        (
            GOOD.replace("  a: {}", "  a:\n    behaviour: {fail_status: 200}"),
            5,
            "fleet.a.behaviour.fail_status",
            "400",
        ),
        # stream_end on a request that does not stream.
        (
            GOOD.replace("status: {200: 2}", "stream_end: done"),
            9,
            "steps[0].expect.stream_end",
            "stream: true",
        ),
        # A step with two actions.
        (
            GOOD.replace("  - send: {count: 2}", "  - wait: 1\n    send: {count: 2}"),
            7,
            "steps[0]",
            "exactly one of",
        ),
        # `busiest` names no worker: a worker may not take the name.
        (GOOD.replace("  b: {}", "  busiest: {}"), 5, "fleet.busiest", "reserved"),
        # A cache threshold is a share of the prompt.
        (
            GOOD.replace("fleet:", "settings:\n  cache_aware: {cache_threshold: 1.5}\nfleet:"),
            4,
            "settings.cache_aware.cache_threshold",
            "between 0 and 1",
        ),
        # Broken YAML.
        (GOOD.replace("fleet:", "fleet: [unclosed"), 4, "", "not valid YAML"),
    ],
)
def test_a_bad_case_names_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: int, field: str, words: str
) -> None:
    path = write(tmp_path, text)
    code, err = validate(tmp_path, capsys)
    assert code == 2
    prefix = f"{path}:{line}: {field}: " if field else f"{path}:{line}: "
    assert err.startswith(prefix), err
    assert words in err


def test_every_bad_file_is_reported_and_good_ones_still_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, GOOD, "good.yaml")
    first = write(tmp_path, GOOD.replace("count: 2", "count: -1"), "bad1.yaml")
    second = write(
        tmp_path,
        GOOD.replace("route", "x").replace("send: {count: 2}", "send: {route: grpc}"),
        "bad2.yaml",
    )
    code = main(["--spec", str(tmp_path), "validate"])
    out, err = capsys.readouterr()
    assert code == 2
    assert f"{first}:7: steps[0].send.count: must be >= 1" in err
    assert (
        f"{second}:7: steps[0].send.route: must be one of chat, completions, generate, responses, messages, embeddings"
        in err
    )
    assert "1 valid case(s), 2 error(s)" in out


def test_the_repository_spec_and_divergence_files_are_valid(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert main(["validate"]) == 0
    out = capsys.readouterr().out
    count = int(out.split()[0])
    assert count >= 25


DISCOVERY = """\
name: a discovery case
description: a worker drains while a request is in flight
discovery: etcd
fleet:
  a: {}
  b: {}
steps:
  - send: {count: 1, background: long}
  - set_status: {worker: a, status: draining}
  - remove: b
  - add: [b]
  - send: {count: 1, raw: {nested: 5}}
  - await: long
    expect: {status: 200}
"""


def test_background_sends_raw_bodies_and_fleet_changes_load(tmp_path: Path) -> None:
    from conformance.model import AwaitStep, FleetChangeStep, SendStep

    case = load_case(write(tmp_path, DISCOVERY), tmp_path)
    assert case.discovery == "etcd"
    assert {"discovery.etcd", "worker.status"} <= case.capabilities_needed()
    kinds = [type(step).__name__ for step in case.steps]
    assert kinds == [
        "SendStep",
        "FleetChangeStep",
        "FleetChangeStep",
        "FleetChangeStep",
        "SendStep",
        "AwaitStep",
    ]
    first, change, _, add, raw, wait = case.steps
    assert isinstance(first, SendStep) and first.request.background == "long"
    assert isinstance(change, FleetChangeStep) and (
        change.action,
        change.workers,
        change.status,
    ) == ("set_status", ("a",), "draining")
    assert isinstance(add, FleetChangeStep) and add.workers == ("b",)
    assert isinstance(raw, SendStep) and raw.request.raw is not None and raw.request.raw.nested == 5
    assert isinstance(wait, AwaitStep) and wait.name == "long"


@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        # A capability nobody declares, with a suggestion.
        (
            GOOD.replace("fleet:", "requires: [breaker.single_prob]\nfleet:"),
            3,
            "requires",
            "did you mean 'breaker.single_probe'",
        ),
        # A fleet change needs a discovery backend to happen in.
        (DISCOVERY.replace("discovery: etcd\n", ""), 8, "steps[1].set_status", "set `discovery`"),
        (
            DISCOVERY.replace("discovery: etcd", "discovery: consul"),
            3,
            "discovery",
            "must be one of etcd, kubernetes",
        ),
        # An await of a name no send started, and a send never awaited.
        (
            DISCOVERY.replace("await: long", "await: short"),
            13,
            "steps[5].await",
            "no background send 'short'",
        ),
        (
            DISCOVERY.replace("  - await: long\n    expect: {status: 200}\n", ""),
            12,
            "steps",
            "never awaited: long",
        ),
        # A background send is checked by its await, not by itself.
        (
            DISCOVERY.replace("background: long}", "background: long}\n    expect: {status: 200}"),
            9,
            "steps[0].expect",
            "await step",
        ),
        # A raw body is one thing.
        (
            DISCOVERY.replace("raw: {nested: 5}", "raw: {nested: 5, size: 10}"),
            12,
            "steps[4].send.raw",
            "exactly one of text, nested, size",
        ),
        (
            DISCOVERY.replace("raw: {nested: 5}", "raw: {text: 5}"),
            12,
            "steps[4].send.raw.text",
            "must be a string",
        ),
        (
            DISCOVERY.replace("raw: {nested: 5}", "raw: {nested: 5}, body: {n: 2}"),
            12,
            "steps[4].send.body",
            "no body fields",
        ),
    ],
)
def test_a_bad_new_field_names_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: int, field: str, words: str
) -> None:
    path = write(tmp_path, text)
    (tmp_path / "VERSION").write_text("1\n")
    code, err = validate(tmp_path, capsys)
    assert code == 2
    assert err.startswith(f"{path}:{line}: {field}: "), err
    assert words in err


def test_validate_checks_a_module_class_plane_and_the_spec_version(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert main(["validate", "--plane", "tests.conformance.stub_planes:StubPlane"]) == 0
    assert (
        main(
            [
                "list",
                "--plane",
                "tests.conformance.stub_planes:StubPlane",
                "--case",
                "raw/non-json-is-400",
            ]
        )
        == 0
    )
    assert "raw/non-json-is-400" in capsys.readouterr().out
    assert main(["validate", "--plane", "tests.conformance.test_validate:TypoPlane"]) == 2
    assert "plane typo: unknown capability 'breaker.singel_probe'" in capsys.readouterr().err
    # A spec root without VERSION is invalid.
    spec = tmp_path / "spec"
    write(spec, GOOD)
    assert main(["--spec", str(spec), "run", "--plane", "python"]) == 2
    assert "the spec has no version file" in capsys.readouterr().err


class TypoPlane(StubPlane):
    name = "typo"
    capabilities = frozenset({"breaker.singel_probe"})


TRAFFIC = """\
name: traffic settings
description: an alias, a fallback and two classes
fleet:
  a: {model: served}
settings:
  aliases:
    chat: {served: 3, canary: 1}
  fallbacks:
    big: [served]
  priority_classes: [high, low]
  default_priority: high
steps:
  - send: {count: 2, model: chat, priority: low}
    expect:
      status: {200: 2}
"""


def test_traffic_settings_load_and_imply_their_capabilities(tmp_path: Path) -> None:
    case = load_case(write(tmp_path, TRAFFIC), tmp_path)
    s = case.settings
    assert s.aliases == {"chat": {"served": 3.0, "canary": 1.0}}
    assert s.fallbacks == {"big": ("served",)}
    assert (s.priority_classes, s.default_priority) == (("high", "low"), "high")
    step = case.steps[0]
    assert isinstance(step, SendStep) and step.request.priority == "low"
    assert {
        "model.alias",
        "model.alias_weights",
        "model.fallback",
        "admission.priority",
    } <= case.capabilities_needed()


@pytest.mark.parametrize(
    ("text", "line", "field", "words"),
    [
        (
            TRAFFIC.replace("priority: low}", "priority: urgent}"),
            13,
            "steps[0].priority",
            "'urgent'",
        ),
        (
            TRAFFIC.replace("default_priority: high", "default_priority: mid"),
            11,
            "settings.default_priority",
            "one of the priority classes",
        ),
        (
            TRAFFIC.replace("served: 3,", "served: 0,"),
            7,
            "settings.aliases.chat.served",
            "must be > 0",
        ),
        (
            TRAFFIC.replace("big: [served]", "big: []"),
            9,
            "settings.fallbacks.big",
            "names no fallback",
        ),
    ],
)
def test_bad_traffic_settings_name_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: int, field: str, words: str
) -> None:
    path = write(tmp_path, text)
    (tmp_path / "VERSION").write_text("1\n")
    code, err = validate(tmp_path, capsys)
    assert code == 2
    assert err.startswith(f"{path}:{line}: {field}: "), err
    assert words in err


LORA = """\
name: adapters
description: engines holding LoRA adapters, a model list read with GET
fleet:
  a: {lora_adapters: [x, y], max_loras: 2}
  b: {lora_adapters: []}
  c: {}
steps:
  - poll: {route: models, within_s: 5}
    expect:
      lists_models: {m: null, x: m}
  - set_behaviour: {worker: a, behaviour: {lora_adapters: [x]}}
  - send: {model: x, route: completions}
"""


def test_lora_workers_and_model_lists_load_and_imply_their_capability(tmp_path: Path) -> None:
    case = load_case(write(tmp_path, LORA), tmp_path)
    a, b, c = case.fleet
    assert (a.lora_adapters, a.max_loras, b.lora_adapters, c.lora_adapters) == (
        ("x", "y"),
        2,
        (),
        None,
    )
    poll = case.steps[0]
    assert not isinstance(poll, SendStep)
    assert poll.expect.lists_models == {"m": None, "x": "m"}  # type: ignore[union-attr]
    needed = case.capabilities_needed()
    assert "lora.adapters" in needed and "route.completions" in needed
    assert "route.models" not in needed  # GET /v1/models: every plane serves it


@pytest.mark.parametrize(
    ("fragment", "message"),
    [
        ("  a: {lora_adapters: x}\n", "fleet.a.lora_adapters: must be a list of adapter names"),
        ("  a: {lora_adapters: [x], max_loras: 0}\n", "fleet.a.max_loras"),
        ("  a: {max_loras: 2}\n", "fleet.a.max_loras: only a worker with lora_adapters"),
    ],
)
def test_bad_lora_fields_name_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fragment: str, message: str
) -> None:
    write(tmp_path, GOOD.replace("  a: {}\n", fragment))
    code, err = validate(tmp_path, capsys)
    assert code != 0 and message in err
