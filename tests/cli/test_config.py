"""Settings: flag > environment > file > default, checked with messages that name the source."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from router.cli.config import (
    ConfigError,
    Settings,
    add_arguments,
    describe_options,
    load_settings,
    traffic_settings,
)
from router.cli.options import OPTIONS
from router.discovery.static import parse_worker_spec, read_workers_file
from router.edge.claims import PriorityClasses
from router.fleet.records import DESCRIPTIVE_FACTS, InvalidWorkerRecord, Role, Status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="router serve")
    add_arguments(parser)
    return parser


def _load(argv: Sequence[str] = (), env: dict[str, str] | None = None) -> Settings:
    return load_settings(_parser().parse_args(list(argv)), env or {})


def _config(tmp_path: Path, text: str, name: str = "router.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- precedence --------------------------------------------------------------------------


def test_default_when_nothing_says_otherwise() -> None:
    settings = _load()
    assert settings == Settings.defaults()
    assert (settings.host, settings.port, settings.policy) == ("127.0.0.1", 8080, "round_robin")
    assert settings.workers == ()


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    config = _config(
        tmp_path, "policy: random\nport: 9001\nmax-attempts: 5\nshutdown_grace_s: 12\n"
    )
    env = {"ROUTER_POLICY": "least_load", "ROUTER_PORT": "9002", "ROUTER_CONFIG": config}
    settings = _load(["--policy", "power_of_two"], env)
    assert settings.policy == "power_of_two"  # flag over env and file
    assert settings.port == 9002  # env over file
    assert settings.max_attempts == 5  # file over default (dashes or underscores alike)
    assert settings.shutdown_grace_s == 12.0 and isinstance(settings.shutdown_grace_s, float)
    assert settings.health_interval_s == 5.0  # default


def test_config_flag_beats_config_env(tmp_path: Path) -> None:
    chosen = _config(tmp_path, "policy: random\n", "chosen.yaml")
    ignored = _config(tmp_path, "policy: least_load\n", "ignored.yaml")
    assert _load(["--config", chosen], {"ROUTER_CONFIG": ignored}).policy == "random"


def test_choices_match_without_regard_to_case() -> None:
    assert _load(["--log-level", "DEBUG"]).log_level == "debug"


# -- validation: the message names the source -------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--port", "abc"], {}, "--port must be an integer, got 'abc'"),
        (["--port", "70000"], {}, "--port must be <= 65535, got 70000"),
        (["--port", "-1"], {}, "--port must be >= 0, got -1"),
        (["--max-body-bytes", "1.5"], {}, "--max-body-bytes must be an integer, got '1.5'"),
        (["--health-interval-s", "nan"], {}, "--health-interval-s must be a number, not NaN"),
        (["--health-interval-s", "0"], {}, "--health-interval-s must be >= 0.05, got 0.0"),
        (
            ["--policy", "fastest"],
            {},
            "--policy must be one of round_robin, random, least_load, power_of_two, consistent_hash, cache_aware, kv_aware, got 'fastest'",
        ),
        ([], {"ROUTER_MAX_ATTEMPTS": "0"}, "ROUTER_MAX_ATTEMPTS must be >= 1, got 0"),
        (
            [],
            {"ROUTER_BREAKER_ALL_OPEN": "panic"},
            "ROUTER_BREAKER_ALL_OPEN must be one of dispatch, reject, got 'panic'",
        ),
        (
            ["--breaker-cooldown-s", "90"],
            {},
            "breaker_cooldown_s must not exceed breaker_max_cooldown_s (90.0 > 60.0)",
        ),
    ],
)
def test_bad_values_are_refused_with_their_source(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(argv, env)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("port: true\n", "port must be an integer, got True"),
        ("policy: [random]\n", "policy must be a string, got ['random']"),
        ("health_timeout_s: fast\n", "health_timeout_s must be a number, got 'fast'"),
        ("polcy: random\n", "unknown setting(s) polcy"),
        ("- just\n- a list\n", "expected a mapping of settings"),
        ("port: [\n", "config file"),
    ],
)
def test_bad_config_files_are_refused_naming_the_file(
    tmp_path: Path, text: str, message: str
) -> None:
    config = _config(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        _load(["--config", config])
    assert message in str(caught.value)
    assert config in str(caught.value)


def test_a_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file .*missing\.yaml"):
        _load(["--config", str(tmp_path / "missing.yaml")])


def test_defaults_with_overrides_are_validated_too() -> None:
    assert Settings.defaults(port=0, health_interval_s=1).health_interval_s == 1.0
    with pytest.raises(ConfigError, match="policy must be one of"):
        Settings.defaults(policy="nope")
    with pytest.raises(ConfigError, match="unknown setting"):
        Settings.defaults(polcy="random")


# -- --worker specs ------------------------------------------------------------------------


def test_a_bare_url_is_a_mixed_worker_whose_model_is_asked_later() -> None:
    record = parse_worker_spec("http://10.0.0.1:30000/")
    assert (record.id, record.url, record.models, record.role) == (
        "http://10.0.0.1:30000",
        "http://10.0.0.1:30000",
        (),
        Role.MIXED,
    )
    assert record.dp_size == 1 and not record.rank_multiplexed


def test_spec_options() -> None:
    prefill = parse_worker_spec(
        "http://p:30000, role=prefill, model=llama+qwen, bootstrap_port=8998, dp_size=4"
    )
    assert prefill.role is Role.PREFILL
    assert prefill.models == ("llama", "qwen")
    assert prefill.bootstrap_addr == "p:8998"
    assert prefill.dp_size == 4 and prefill.rank_multiplexed
    assert parse_worker_spec("http://m:1,model=base,adapters=a+b").adapters == ("a", "b")
    ranked = parse_worker_spec("http://d:1,role=decode,dp_size=2,dp_rank=1,engine=vllm,id=d-1")
    assert (ranked.id, ranked.engine, ranked.dp_rank, ranked.rank_multiplexed) == (
        "d-1",
        "vllm",
        1,
        False,
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("localhost:8000", "worker URL 'localhost:8000' must start with http://"),
        ("https://a:1", "TLS to workers is not supported"),
        ("http://a:99999", "is malformed"),
        ("http://a:1,gpu=8", "unknown option 'gpu'"),
        ("http://a:1,role", "expected key=value, got 'role'"),
        ("http://a:1,dp_size=two", "dp_size must be an integer, got 'two'"),
        ("http://a:1,role=teacher", "'role' must be one of mixed, prefill, decode"),
        ("http://a:1,dp_size=2,dp_rank=2", "'dp_rank' 2 must be below 'dp_size' 2"),
        # One in-flight counter per rank: a record's number must not size memory unchecked.
        ("http://a:1,dp_size=1000000000", "'dp_size' must be at most 4096"),
    ],
)
def test_bad_specs_name_the_spec_and_the_problem(spec: str, message: str) -> None:
    with pytest.raises(InvalidWorkerRecord) as caught:
        parse_worker_spec(spec)
    assert message in str(caught.value)
    assert repr(spec) in str(caught.value)


def test_a_prefill_without_bootstrap_port_is_accepted_and_leaves_it_to_its_engine() -> None:
    # `router serve --worker http://p:30000,role=prefill` used to refuse to start.
    # (Without engine= the engine's kind is left to the engine too: DESCRIPTIVE_FACTS.)
    record = parse_worker_spec("http://p:30000,role=prefill")
    assert record.bootstrap_addr is None
    assert record.unknown_facts == {"bootstrap_port", "dp_size"} | DESCRIPTIVE_FACTS
    explicit = parse_worker_spec("http://p:30000,role=prefill,dp_size=2,engine=sglang")
    assert (explicit.unknown_facts, explicit.dp_size) == ({"bootstrap_port"}, 2)
    given = parse_worker_spec("http://p:30000,role=prefill,bootstrap_port=8998,engine=sglang")
    assert given.unknown_facts == frozenset() and given.bootstrap_addr == "p:8998"
    decode = parse_worker_spec("http://d:30000,role=decode")
    assert decode.unknown_facts == DESCRIPTIVE_FACTS and decode.engine is None


def test_worker_flags_beat_the_workers_env() -> None:
    env = {"ROUTER_WORKERS": "http://e1:1 http://e2:2"}
    assert [w.url for w in _load([], env).workers] == ["http://e1:1", "http://e2:2"]
    flagged = _load(["--worker", "http://f:1", "--worker", "http://g:1,model=m"], env)
    assert [w.url for w in flagged.workers] == ["http://f:1", "http://g:1"]


def test_a_worker_listed_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="worker\\(s\\) listed twice: http://a:1"):
        _load(["--worker", "http://a:1", "--worker", "http://a:1/"])


# -- workers files ---------------------------------------------------------------------------

FLEET = """\
- url: http://m1:30000
  model: llama
- http://m2:30000,model=llama
- url: http://p:30000
  role: prefill
  model: [llama]
  bootstrap_port: 8998
- {url: "http://d:30000", role: decode, model: llama, status: draining, dp_size: 2}
"""


def test_a_workers_file_holds_records_and_specs(tmp_path: Path) -> None:
    records = read_workers_file(Path(_config(tmp_path, FLEET, "fleet.yaml")))
    assert [(r.url, r.role.value, r.models) for r in records] == [
        ("http://m1:30000", "mixed", ("llama",)),
        ("http://m2:30000", "mixed", ("llama",)),
        ("http://p:30000", "prefill", ("llama",)),
        ("http://d:30000", "decode", ("llama",)),
    ]
    assert records[2].bootstrap_addr == "p:8998"
    assert records[3].status is Status.DRAINING and records[3].rank_multiplexed


def test_a_workers_file_may_be_a_mapping_with_a_workers_list(tmp_path: Path) -> None:
    path = _config(tmp_path, "workers:\n  - http://a:1\n", "fleet.yaml")
    assert [r.url for r in read_workers_file(Path(path))] == ["http://a:1"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("url: http://a:1\n", "workers must be a list of records"),
        (
            "- url: http://a:1\n- url: ftp://b\n",
            "worker #2: worker URL 'ftp://b' must start with http://",
        ),
        ("- {url: 'http://a:1', dp_size: 0}\n", "worker #1: 'dp_size' must be an integer >= 1"),
        ("- [\n", "fleet.yaml"),
    ],
)
def test_bad_workers_files_name_the_file_and_the_record(
    tmp_path: Path, text: str, message: str
) -> None:
    path = _config(tmp_path, text, "fleet.yaml")
    with pytest.raises(ConfigError) as caught:
        _load(["--workers-file", path])
    assert message in str(caught.value)
    assert path in str(caught.value)


def test_worker_flags_and_a_workers_file_add_up(tmp_path: Path) -> None:
    fleet = _config(tmp_path, "- http://file:1\n", "fleet.yaml")
    other = _config(tmp_path, "- http://env-file:1\n", "other.yaml")
    settings = _load(
        ["--worker", "http://flag:1", "--workers-file", fleet], {"ROUTER_WORKERS_FILE": other}
    )
    assert [w.url for w in settings.workers] == ["http://flag:1", "http://file:1"]
    assert [w.url for w in _load([], {"ROUTER_WORKERS_FILE": other}).workers] == [
        "http://env-file:1"
    ]


def test_config_file_workers_count_only_when_nothing_else_names_a_worker(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text("- http://listed:1\n")
    config = _config(tmp_path, "workers_file: fleet.yaml\nworkers:\n  - http://inline:1\n")
    from_file = _load(["--config", config]).workers
    # workers_file is read relative to the config file, wherever the router starts.
    assert [w.url for w in from_file] == ["http://listed:1", "http://inline:1"]
    assert [w.url for w in _load(["--config", config, "--worker", "http://flag:1"]).workers] == [
        "http://flag:1"
    ]
    assert [
        w.url for w in _load(["--config", config], {"ROUTER_WORKERS": "http://env:1"}).workers
    ] == ["http://env:1"]


# -- one table of options ----------------------------------------------------------------------


# Settings fields that are not options, and the flags that set them.
NOT_OPTIONS = {
    "workers": "--worker, --workers-file",
    "reuse_port": "--reuse-port",
    "model_aliases": "--model-alias",
    "model_fallbacks": "--model-fallback",
}


def test_settings_fields_are_the_options_plus_the_fleet() -> None:
    annotations = {f.name: f.type for f in fields(Settings)}
    assert set(annotations) - {o.name for o in OPTIONS} == set(NOT_OPTIONS)
    defaults = Settings.defaults()
    for option in OPTIONS:
        assert annotations[option.name] == option.kind.__name__, option.name
        value: Any = getattr(defaults, option.name)
        assert value == option.default
        assert type(value) is option.kind, option.name


def test_every_flag_is_described_and_every_description_is_a_flag() -> None:
    help_text = _parser().format_help()
    flags = set(re.findall(r"(--[a-z][a-z0-9-]+)", help_text)) - {"--help"}
    described = {flag for flag, _, _, _ in describe_options()}
    assert flags == described
    for flag, env, _, _ in describe_options():
        assert env.startswith("ROUTER_")
        assert env in help_text, flag


def test_a_fleet_file_record_may_carry_its_workers_key_which_is_never_listed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("- {url: 'http://10.0.0.5:30000', model: m, api_key: worker-secret-1}\n")
    [record] = read_workers_file(path)
    assert record.api_key == "worker-secret-1"
    assert "api_key" not in record.to_json() and "worker-secret-1" not in repr(record)


def test_a_bad_worker_key_is_refused_without_repeating_it(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("- {url: 'http://10.0.0.5:30000', model: m, api_key: 'two words'}\n")
    with pytest.raises(InvalidWorkerRecord, match="api_key") as caught:
        read_workers_file(path)
    assert "two words" not in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "expected"), [("true", True), ("1", True), ("off", False), ("NO", False)]
)
def test_a_yes_no_option_reads_words_from_the_environment(raw: str, expected: bool) -> None:
    assert _load(env={"ROUTER_PROTECT_METRICS": raw}).protect_metrics is expected


def test_a_bare_yes_no_flag_means_yes_and_a_bad_word_is_refused() -> None:
    assert _load(["--protect-metrics"]).protect_metrics is True
    assert _load().protect_metrics is False
    with pytest.raises(ConfigError, match="--protect-metrics must be true or false"):
        _load(["--protect-metrics", "maybe"])


# -- traffic policy --------------------------------------------------------------------------


def test_traffic_settings_come_from_flags_env_and_file(tmp_path: Path) -> None:
    config = _config(tmp_path, "priority_classes: interactive, batch\ntenant_max_queued: 3\n")
    settings = _load(
        ["--config", config, "--lowest-priority-share", "0.1"],
        {"ROUTER_DEFAULT_PRIORITY": "interactive", "ROUTER_TENANT_HEADER": "X-Team"},
    )
    traffic = traffic_settings(settings)
    assert traffic.classes == PriorityClasses(("interactive", "batch"), "interactive", 0.1)
    assert (traffic.tenant_header, traffic.tenant_max_queued) == ("x-team", 3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--priority-classes", "high,low"],
            "traffic policy: the default priority '' is not one of the classes (high, low)",
        ),
        (
            ["--priority-classes", "high,high", "--default-priority", "high"],
            "traffic policy: priority classes repeat a name: high, high",
        ),
        (["--default-priority", "high"], "traffic policy: a default priority ('high') needs"),
        (["--tenant-header", "authorization"], "traffic policy: tenant header 'authorization'"),
        (["--lowest-priority-share", "0.95"], "--lowest-priority-share must be <= 0.9"),
        (["--engine-priority-scheduling"], "engine_priority_scheduling sends each request's"),
    ],
)
def test_a_traffic_policy_that_cannot_work_stops_the_start(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(argv)
    assert str(caught.value).startswith(message)


# -- aliases and fallbacks -------------------------------------------------------------------


def test_aliases_and_fallbacks_come_from_flags_env_or_file(tmp_path: Path) -> None:
    flags = _load(
        [
            "--model-alias",
            "chat=v1:95,v2:5",
            "--model-alias",
            "fast=v3",
            "--model-fallback",
            "v1=v3",
        ]
    )
    assert flags.model_aliases == (
        ("chat", (("v1", 95.0), ("v2", 5.0))),
        ("fast", (("v3", 1.0),)),
    )
    assert flags.model_fallbacks == (("v1", ("v3",)),)
    env = _load([], {"ROUTER_MODEL_ALIAS": "chat=v1 fast=v3", "ROUTER_MODEL_FALLBACK": "v1=v2,v3"})
    assert env.model_aliases == (("chat", (("v1", 1.0),)), ("fast", (("v3", 1.0),)))
    assert env.model_fallbacks == (("v1", ("v2", "v3")),)
    config = _config(
        tmp_path,
        "model_alias:\n  chat: {v1: 95, v2: 5}\n  fast: v3\n"
        "model_fallback:\n  v1: [v3]\n  v2: v3\n",
    )
    from_file = _load(["--config", config])
    assert from_file.model_aliases == (("chat", (("v1", 95), ("v2", 5))), ("fast", (("v3", 1.0),)))
    assert from_file.model_fallbacks == (("v1", ("v3",)), ("v2", ("v3",)))
    listed = _config(tmp_path, "model_alias: ['chat=v1:3,v2:1']\n", "listed.yaml")
    assert _load(["--config", listed]).model_aliases == (("chat", (("v1", 3.0), ("v2", 1.0))),)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-alias", "chat"], "--model-alias 'chat': expected ALIAS=MODEL"),
        (["--model-alias", "chat=v1:lots"], "--model-alias 'chat=v1:lots': the weight of 'v1'"),
        (
            ["--model-alias", "a=b", "--model-alias", "b=a"],
            "model names: alias 'a' names the alias",
        ),
        (["--model-alias", "a=a"], "model names: alias 'a' names itself"),
        (
            ["--model-fallback", "big=small", "--model-fallback", "small=big"],
            "model names: model fallbacks loop: big -> small -> big",
        ),
        (["--model-fallback", "big="], "--model-fallback 'big=': expected MODEL=FALLBACK"),
    ],
)
def test_names_that_loop_or_do_not_parse_stop_the_start(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(argv)
    assert str(caught.value).startswith(message)
