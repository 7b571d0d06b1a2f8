"""Router settings from flags, `ROUTER_*` environment variables and a YAML file.

Precedence: flag > environment > file > default. Every option is declared once in
`router.cli.options.OPTIONS`; the flag, the environment variable and the file key are derived
from its name, so `docs/operations.md` and `router serve --help` cannot drift apart.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from router.cli.options import ENV_PREFIX, OPTIONS, Option
from router.discovery.kube_pods import BadSelector, pod_sources
from router.discovery.static import parse_worker_spec, read_workers_file, records_from_list
from router.edge.claims import PriorityClasses, TrafficSettings, TrafficSettingsError
from router.fleet.records import InvalidWorkerRecord, WorkerRecord
from router.observability.garbage_collection import DEFAULT_YOUNG_THRESHOLD
from router.pipeline.model_names import ModelNames, ModelNamesError
from router.pipeline.resume import parse_routes
from router.prompts.token_sources import parse_order

WORKERS_ENV = ENV_PREFIX + "WORKERS"
WORKERS_FILE_ENV = ENV_PREFIX + "WORKERS_FILE"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
MODEL_ALIAS_ENV = ENV_PREFIX + "MODEL_ALIAS"
MODEL_FALLBACK_ENV = ENV_PREFIX + "MODEL_FALLBACK"
MODEL_ALIAS_HELP = "a public model name for served models with weights: ALIAS=MODEL[:WEIGHT][,MODEL[:WEIGHT]...] (a canary: chat=v1:95,v2:5)"
MODEL_FALLBACK_HELP = "the models a model gives way to when it has no worker that can take a request (never for an unknown model): MODEL=FALLBACK[,FALLBACK...]"
WORKER_HELP = "a static worker: its URL, then optional role=, model= (a+b for several), adapters= (LoRA adapters it holds, a+b), bootstrap_port=, dp_size=, dp_rank=, engine=, id="
WORKERS_FILE_HELP = "YAML list of worker records (or a mapping with a `workers` list)"
CONFIG_HELP = (
    "YAML file of settings: any option by its name (host, policy, ...), plus workers / workers_file"
)


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the setting, its source and why."""


_BY_NAME = {option.name: option for option in OPTIONS}
_KIND_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
_BOOL_WORDS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


@dataclass(frozen=True, slots=True)
class Settings:
    host: str
    port: int
    policy: str
    prefill_policy: str
    decode_policy: str
    discovery: str
    etcd_endpoint: str
    etcd_prefix: str
    health_interval_s: float
    health_timeout_s: float
    health_failure_threshold: int
    health_success_threshold: int
    max_attempts: int
    connect_timeout_s: float
    first_byte_timeout_s: float
    stream_idle_timeout_s: float
    breaker_failure_threshold: int
    breaker_cooldown_s: float
    breaker_max_cooldown_s: float
    breaker_all_open: str
    retry_after_s: float
    max_body_bytes: int
    max_connections: int
    header_timeout_s: float
    idle_timeout_s: float
    shutdown_grace_s: float
    pool_max_idle_per_worker: int
    pool_idle_expiry_s: float
    log_level: str
    workers: tuple[WorkerRecord, ...] = ()
    model_aliases: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    model_fallbacks: tuple[tuple[str, tuple[str, ...]], ...] = ()
    server: str = "native"
    processes: int = 1
    gc_young_threshold: int = DEFAULT_YOUNG_THRESHOLD
    reuse_port: bool = False
    k8s_namespace: str = ""
    k8s_selector: str = ""
    k8s_prefill_selector: str = ""
    k8s_decode_selector: str = ""
    k8s_port: int = 8000
    k8s_kubeconfig: str = ""
    max_n: int = 128
    model_memory_s: float = 300.0
    discovery_silence_s: float = 15.0
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**26
    kv_events_port: int = 0
    kv_events_replay_port: int = 0
    kv_overlap_weight: float = 2.0
    kv_token_sources: str = "tokenizer,model_dir,engine"
    kv_tokenize_timeout_s: float = 0.5
    kv_tokenize_max_concurrent: int = 64
    engine_load_interval_s: float = 0.5
    engine_load_timeout_s: float = 1.0
    engine_load_window_s: float = 0.25
    engine_server_load_interval_s: float = 0.1
    engine_server_load_window_s: float = 0.05
    adapter_list_interval_s: float = 5.0
    adapter_slot_cost: float = 1.0
    adapter_wait_cost: float = 4.0
    spread_margin: float = 0.5
    policy_seed: int = -1
    kv_tokenizer: str = ""
    api_key: str = ""
    api_keys_file: str = ""
    protect_metrics: bool = False
    worker_api_key: str = ""
    max_concurrent_requests: int = 0
    queue_size: int = 100
    queue_timeout_s: float = 60.0
    priority_classes: str = ""
    default_priority: str = ""
    lowest_priority_share: float = 0.0
    tenant_header: str = ""
    tenant_max_inflight: int = 0
    tenant_max_queued: int = 0
    admission_metrics_by_tenant: bool = False
    alias_answer_model: str = "served"
    engine_priority_scheduling: bool = False
    worker_max_inflight: int = 0
    wait_for_workers_s: float = 5.0
    admin_api_key: str = ""
    otlp_traces_endpoint: str = ""
    body_timeout_s: float = 30.0
    client_write_timeout_s: float = 60.0
    max_buffered_body_bytes: int = 1024**3
    max_connections_per_worker: int = 256
    resume_limit: int = 2
    resume_routes: str = "chat,completions"
    resume_max_ids: int = 65_536

    @classmethod
    def defaults(cls, **overrides: Any) -> Settings:
        """Default settings with `overrides` applied and validated (for tests and embedding)."""
        values = {option.name: option.default for option in OPTIONS}
        values.update(overrides)
        return _validated(values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every option as a flag; defaults stay None so precedence can be resolved."""
    for option in OPTIONS:
        choices = f"one of {', '.join(option.choices)}; " if option.choices else ""
        # A yes/no option works as a bare flag (`--protect-metrics`) and takes a value too.
        yes_no = option.kind is bool
        parser.add_argument(
            option.flag,
            dest=option.name,
            default=None,
            help=f"{option.help} ({choices}env {option.env}; default {option.default})",
            nargs="?" if yes_no else None,
            const="true" if yes_no else None,
        )
    parser.add_argument(
        "--worker",
        dest="worker",
        action="append",
        default=None,
        metavar="URL[,role=R,model=M,bootstrap_port=P,dp_size=N]",
        help=f"{WORKER_HELP} (repeatable; env {WORKERS_ENV}, space-separated)",
    )
    parser.add_argument(
        "--workers-file",
        dest="workers_file",
        default=None,
        help=f"{WORKERS_FILE_HELP} (env {WORKERS_FILE_ENV})",
    )
    parser.add_argument(
        "--config", dest="config", default=None, help=f"{CONFIG_HELP} (env {CONFIG_ENV})"
    )
    parser.add_argument(
        "--model-alias",
        dest="model_alias",
        action="append",
        default=None,
        metavar="ALIAS=MODEL[:WEIGHT],...",
        help=f"{MODEL_ALIAS_HELP} (repeatable; env {MODEL_ALIAS_ENV}, space-separated)",
    )
    parser.add_argument(
        "--model-fallback",
        dest="model_fallback",
        action="append",
        default=None,
        metavar="MODEL=FALLBACK,...",
        help=f"{MODEL_FALLBACK_HELP} (repeatable; env {MODEL_FALLBACK_ENV}, space-separated)",
    )


def load_settings(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
    """Resolve flag > env > file > default and validate; raises ConfigError with the reason.

    Every value is checked where it came from, so the message names the flag, the
    environment variable or the file key the operator has to fix.
    Workers: `--worker` flags (else `ROUTER_WORKERS`) together with the records of
    `--workers-file` (else `ROUTER_WORKERS_FILE`); the config file's `workers` /
    `workers_file` only when neither flags nor environment name any worker.
    """
    environ = os.environ if environ is None else environ
    file_values: dict[str, Any] = {}
    config_path = args.config or environ.get(CONFIG_ENV)
    if config_path:
        file_values = _read_yaml_mapping(Path(config_path), "config file")
        extra = {"workers", "workers_file", "model_alias", "model_fallback"}
        unknown = sorted(set(file_values) - set(_BY_NAME) - extra)
        if unknown:
            raise ConfigError(
                f"config file {config_path}: unknown setting(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted([*_BY_NAME, *extra]))})"
            )
    values: dict[str, Any] = {}
    for option in OPTIONS:
        flag_value = getattr(args, option.name, None)
        if flag_value is not None:
            values[option.name] = _convert(option, flag_value, option.flag)
        elif option.env in environ:
            values[option.name] = _convert(option, environ[option.env], option.env)
        elif option.name in file_values:
            values[option.name] = _convert(
                option, file_values[option.name], f"config file {config_path}: {option.name}"
            )
        else:
            values[option.name] = option.default
    values["workers"] = tuple(_worker_records(args, environ, file_values, config_path))
    values["model_aliases"], values["model_fallbacks"] = _model_names(
        args, environ, file_values, config_path
    )
    return _validated(values)


def _worker_records(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    file_values: Mapping[str, Any],
    config_path: str | None,
) -> list[WorkerRecord]:
    try:
        records = [parse_worker_spec(spec) for spec in (args.worker or [])]
        if not records and environ.get(WORKERS_ENV):
            records = [parse_worker_spec(spec) for spec in environ[WORKERS_ENV].split()]
        workers_file = args.workers_file or environ.get(WORKERS_FILE_ENV)
        if workers_file:
            records += read_workers_file(Path(workers_file))
        if records or workers_file or config_path is None:
            return records
        if "workers_file" in file_values:
            # Relative to the config file, which is where its author looked from.
            path = Path(config_path).parent / str(file_values["workers_file"])
            records += read_workers_file(path)
        if "workers" in file_values:
            records += records_from_list(file_values["workers"], f"config file {config_path}")
    except InvalidWorkerRecord as exc:
        raise ConfigError(str(exc)) from None
    return records


# -- aliases and fallbacks: ALIAS=MODEL[:WEIGHT],... and MODEL=FALLBACK,... ----------------


def _model_names(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    file_values: Mapping[str, Any],
    config_path: str | None,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The aliases and the fallbacks, each from its flags, else its variable, else the
    config file (a list of flag specs, or a mapping)."""
    aliases = _name_specs("model_alias", "--model-alias", MODEL_ALIAS_ENV, args, environ)
    fallbacks = _name_specs("model_fallback", "--model-fallback", MODEL_FALLBACK_ENV, args, environ)
    if aliases is None and "model_alias" in file_values:
        source = f"config file {config_path}: model_alias"
        aliases = _from_file("model_alias", file_values["model_alias"], source)
    if fallbacks is None and "model_fallback" in file_values:
        source = f"config file {config_path}: model_fallback"
        fallbacks = _from_file("model_fallback", file_values["model_fallback"], source)
    return tuple(aliases or ()), tuple(fallbacks or ())


def _name_specs(
    kind: str, flag: str, env: str, args: argparse.Namespace, environ: Mapping[str, str]
) -> list[Any] | None:
    """The specs of `kind` from its flags, else its variable; None when neither gives any."""
    parse = _alias_spec if kind == "model_alias" else _fallback_spec
    given = getattr(args, kind, None)
    if given:
        return [parse(spec, flag) for spec in given]
    if environ.get(env):
        return [parse(spec, env) for spec in environ[env].split()]
    return None


def _alias_spec(spec: str, source: str) -> tuple[str, tuple[tuple[str, float], ...]]:
    name, _, targets = spec.partition("=")
    if not name.strip() or not targets.strip():
        raise ConfigError(f"{source} {spec!r}: expected ALIAS=MODEL[:WEIGHT][,MODEL[:WEIGHT]...]")
    parsed = []
    for target in targets.split(","):
        model, _, weight = target.strip().partition(":")
        try:
            parsed.append((model.strip(), float(weight) if weight.strip() else 1.0))
        except ValueError:
            raise ConfigError(
                f"{source} {spec!r}: the weight of {model.strip()!r} must be a number, got {weight!r}"
            ) from None
    return name.strip(), tuple(parsed)


def _fallback_spec(spec: str, source: str) -> tuple[str, tuple[str, ...]]:
    name, _, models = spec.partition("=")
    if not name.strip() or not models.strip():
        raise ConfigError(f"{source} {spec!r}: expected MODEL=FALLBACK[,FALLBACK...]")
    return name.strip(), tuple(model.strip() for model in models.split(","))


def _from_file(kind: str, value: Any, source: str) -> list[Any]:
    """A config file's aliases or fallbacks: a list of flag specs, or a mapping (`alias:
    model`, `alias: {model: weight}`; `model: fallback`, `model: [fallback, ...]`)."""
    parse = _alias_spec if kind == "model_alias" else _fallback_spec
    if isinstance(value, list) and all(isinstance(spec, str) for spec in value):
        return [parse(spec, source) for spec in value]
    if not isinstance(value, dict):
        raise ConfigError(f"{source} must be a mapping or a list of specs, got {value!r}")
    entries: list[Any] = []
    for name, target in value.items():
        if kind == "model_alias":
            if isinstance(target, str):
                entries.append((str(name), ((target, 1.0),)))
            elif isinstance(target, dict):
                entries.append((str(name), tuple((str(m), w) for m, w in target.items())))
            else:
                raise ConfigError(
                    f"{source}.{name} must be a model or a mapping of model to weight, got {target!r}"
                )
        elif isinstance(target, str):
            entries.append((str(name), (target,)))
        elif isinstance(target, list) and all(isinstance(model, str) for model in target):
            entries.append((str(name), tuple(target)))
        else:
            raise ConfigError(
                f"{source}.{name} must be a model or a list of models, got {target!r}"
            )
    return entries


def model_names(settings: Settings) -> ModelNames:
    """The aliases and fallbacks of `settings`, resolved (checked by `load_settings`)."""
    return ModelNames(dict(settings.model_aliases), dict(settings.model_fallbacks))


def _validated(values: dict[str, Any]) -> Settings:
    for option in OPTIONS:
        values[option.name] = _check(option, values[option.name], option.name)
    if values["breaker_cooldown_s"] > values["breaker_max_cooldown_s"]:
        raise ConfigError(
            "breaker_cooldown_s must not exceed breaker_max_cooldown_s "
            f"({values['breaker_cooldown_s']} > {values['breaker_max_cooldown_s']})"
        )
    if values["discovery"] == "kubernetes":
        try:
            pod_sources(
                values["k8s_selector"],
                values["k8s_prefill_selector"],
                values["k8s_decode_selector"],
            )
        except BadSelector as exc:
            raise ConfigError(str(exc)) from None
    try:
        parse_order(values["kv_token_sources"])
    except ValueError as exc:
        raise ConfigError(f"kv_token_sources: {exc}") from None
    try:
        parse_routes(values["resume_routes"])
    except ValueError as exc:
        raise ConfigError(f"resume_routes: {exc}") from None
    ids = [record.id for record in values.get("workers", ())]
    duplicates = sorted({worker_id for worker_id in ids if ids.count(worker_id) > 1})
    if duplicates:
        raise ConfigError(f"worker(s) listed twice: {', '.join(duplicates)}")
    known = {f.name for f in fields(Settings)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}")
    settings = Settings(**values)
    try:
        traffic = traffic_settings(settings)
    except TrafficSettingsError as exc:
        raise ConfigError(f"traffic policy: {exc}") from None
    try:
        model_names(settings)
    except ModelNamesError as exc:
        raise ConfigError(f"model names: {exc}") from None
    if settings.engine_priority_scheduling and not traffic.classes.names:
        raise ConfigError(
            "engine_priority_scheduling sends each request's priority class to the engines: "
            "it needs priority_classes"
        )
    return settings


def traffic_settings(settings: Settings) -> TrafficSettings:
    """The admission gate's classes and tenant defaults; TrafficSettingsError when they
    cannot be used (a default priority that is no class, a reserved tenant header, ...)."""
    names = tuple(name.strip() for name in settings.priority_classes.split(",") if name.strip())
    return TrafficSettings(
        classes=PriorityClasses(
            names=names,
            default=settings.default_priority.strip(),
            lowest_share=settings.lowest_priority_share,
        ),
        tenant_header=settings.tenant_header.strip().lower(),
        tenant_max_inflight=settings.tenant_max_inflight,
        tenant_max_queued=settings.tenant_max_queued,
    )


def _check(option: Option, value: Any, source: str) -> Any:
    """`value` if `option` accepts it; ConfigError naming `source` otherwise."""
    if option.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source} must be true or false, got {value!r}")
        return value
    if option.kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source} must be a string, got {value!r}")
        if option.choices is not None:
            lowered = value.lower()
            if lowered not in option.choices:
                raise ConfigError(
                    f"{source} must be one of {', '.join(option.choices)}, got {value!r}"
                )
            return lowered
        return value
    kind = "an integer" if option.kind is int else "a number"
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (option.kind is int and isinstance(value, float))
    ):
        raise ConfigError(f"{source} must be {kind}, got {value!r}")
    if math.isnan(value):
        raise ConfigError(f"{source} must be {kind}, not NaN")
    if option.minimum is not None and value < option.minimum:
        raise ConfigError(f"{source} must be >= {option.minimum:g}, got {value!r}")
    if option.maximum is not None and value > option.maximum:
        raise ConfigError(f"{source} must be <= {option.maximum:g}, got {value!r}")
    return float(value) if option.kind is float else value


def _convert(option: Option, raw: Any, source: str) -> Any:
    """A flag, environment or file value in the option's type, checked (ConfigError names `source`)."""
    if option.kind is bool:
        word = raw if isinstance(raw, bool) else _BOOL_WORDS.get(str(raw).strip().lower(), raw)
        return _check(option, word, source)
    if isinstance(raw, bool) or raw is None or isinstance(raw, list | dict):
        # YAML gives these types directly; none of them is a valid setting value.
        raise ConfigError(f"{source} must be {_KIND_WORDS[option.kind]}, got {raw!r}")
    value: Any = raw
    if option.kind is not str and isinstance(raw, str):
        try:
            value = option.kind(raw.strip())
        except ValueError:
            raise ConfigError(f"{source} must be {_KIND_WORDS[option.kind]}, got {raw!r}") from None
    elif option.kind is str:
        value = str(raw)
    return _check(option, value, source)


def _read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{what} {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: expected a mapping of settings")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def describe_options() -> Sequence[tuple[str, str, Any, str]]:
    """(flag, env var, default, help) of every `router serve` flag, for docs and tests."""
    rows: list[tuple[str, str, Any, str]] = [(o.flag, o.env, o.default, o.help) for o in OPTIONS]
    rows += [
        ("--worker", WORKERS_ENV, None, WORKER_HELP),
        ("--workers-file", WORKERS_FILE_ENV, None, WORKERS_FILE_HELP),
        ("--config", CONFIG_ENV, None, CONFIG_HELP),
        ("--model-alias", MODEL_ALIAS_ENV, None, MODEL_ALIAS_HELP),
        ("--model-fallback", MODEL_FALLBACK_ENV, None, MODEL_FALLBACK_HELP),
    ]
    return rows
