"""Every `router serve` option, declared once: its name, kind, default, help and bounds.

The flag (`--name-with-dashes`), the environment variable (`ROUTER_NAME`) and the YAML key
(`name`) are derived from the name, so `router serve --help`, `docs/operations.md` and
the config file cannot drift apart. `router.cli.config` reads and checks the values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.observability.garbage_collection import DEFAULT_YOUNG_THRESHOLD
from router.policies.by_name import POLICY_NAMES

ENV_PREFIX = "ROUTER_"


@dataclass(frozen=True, slots=True)
class Option:
    name: str
    kind: type[str] | type[int] | type[float] | type[bool]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("host", str, "127.0.0.1", "address to listen on"),
    Option("port", int, 8080, "port to listen on (0 picks a free one)", minimum=0, maximum=65535),
    Option("policy", str, "round_robin", "policy for mixed workers", POLICY_NAMES),
    Option("prefill_policy", str, "round_robin", "policy for the prefill pool", POLICY_NAMES),
    Option("decode_policy", str, "round_robin", "policy for the decode pool", POLICY_NAMES),
    Option(
        "discovery", str, "static", "where the fleet comes from", ("static", "etcd", "kubernetes")
    ),
    Option("etcd_endpoint", str, "http://127.0.0.1:2379", "etcd client URL (v3 JSON gateway)"),
    Option("etcd_prefix", str, "/router/workers/", "etcd key prefix of worker records"),
    Option("health_interval_s", float, 5.0, "seconds between active health checks", minimum=0.05),
    Option("health_timeout_s", float, 2.0, "timeout of one health check", minimum=0.05),
    Option(
        "health_failure_threshold", int, 2, "failed checks before a worker is unhealthy", minimum=1
    ),
    Option(
        "health_success_threshold", int, 1, "passed checks before it is healthy again", minimum=1
    ),
    Option("max_attempts", int, 3, "distinct workers tried per request", minimum=1),
    Option("connect_timeout_s", float, 5.0, "upstream connect timeout", minimum=0.001),
    Option(
        "first_byte_timeout_s",
        float,
        120.0,
        "time to upstream response headers (retryable)",
        minimum=0.001,
    ),
    Option(
        "stream_idle_timeout_s",
        float,
        120.0,
        "longest silence mid-stream before it is ended with an error event",
        minimum=0.001,
    ),
    Option(
        "breaker_failure_threshold",
        int,
        3,
        "consecutive faults that open a worker's breaker (0 disables)",
        minimum=0,
    ),
    Option("breaker_cooldown_s", float, 5.0, "first cooldown of an open breaker", minimum=0.001),
    Option("breaker_max_cooldown_s", float, 60.0, "cap of the doubling cooldown", minimum=0.001),
    Option(
        "breaker_all_open",
        str,
        "dispatch",
        "when every candidate of a leg is open",
        ("dispatch", "reject"),
    ),
    Option(
        "retry_after_s",
        float,
        1.0,
        "Retry-After of a 503 when no breaker gives a better figure",
        minimum=1,
    ),
    Option("max_body_bytes", int, 32 * 1024 * 1024, "largest request body (413 beyond)", minimum=1),
    Option("max_connections", int, 10_000, "concurrent client connections", minimum=1),
    Option(
        "header_timeout_s", float, 10.0, "time for a client to send request headers", minimum=0.001
    ),
    Option(
        "idle_timeout_s",
        float,
        75.0,
        "keep-alive idle time before a client connection is closed",
        minimum=0.001,
    ),
    Option(
        "shutdown_grace_s",
        float,
        30.0,
        "time in-flight requests get to finish on SIGTERM",
        minimum=0,
    ),
    Option(
        "pool_max_idle_per_worker", int, 256, "idle upstream connections kept per worker", minimum=0
    ),
    Option(
        "pool_idle_expiry_s",
        float,
        4.0,
        "idle upstream connections are closed after this",
        minimum=0.01,
    ),
    Option("log_level", str, "info", "log level", ("debug", "info", "warning", "error")),
    Option(
        "server",
        str,
        "native",
        "HTTP front: native (trio + llhttp), or hypercorn (the ASGI adapter, for HTTP/2 or TLS; needs the asgi extra)",
        ("native", "hypercorn"),
    ),
    Option(
        "processes",
        int,
        1,
        "router processes sharing the port (SO_REUSEPORT); each keeps its own breaker state and discovery watch; > 1 needs an explicit port",
        minimum=1,
    ),
    Option(
        "gc_young_threshold",
        int,
        DEFAULT_YOUNG_THRESHOLD,
        "Python's garbage collector once serving: net allocations between young collections, with what start-up built frozen (never walked again); 0: Python's own settings (700), nothing frozen",
        minimum=0,
    ),
    Option(
        "k8s_namespace",
        str,
        "",
        "namespace of the worker Pods (empty: the router's own Pod's in a cluster, or the kubeconfig context's, else default)",
    ),
    Option("k8s_selector", str, "", "label selector k=v[,k=v] of mixed worker Pods"),
    Option("k8s_prefill_selector", str, "", "label selector of prefill worker Pods"),
    Option("k8s_decode_selector", str, "", "label selector of decode worker Pods"),
    Option(
        "k8s_port",
        int,
        8000,
        "port of a worker Pod's engine (annotation trio-router/port wins)",
        minimum=1,
        maximum=65535,
    ),
    Option(
        "k8s_kubeconfig",
        str,
        "",
        "kubeconfig file (empty: in-cluster service account, else KUBECONFIG, else ~/.kube/config)",
    ),
    Option(
        "max_n",
        int,
        128,
        "largest n (choices per request) and PD batch size; 400 beyond",
        minimum=1,
        maximum=1_000_000,
    ),
    Option(
        "model_memory_s",
        float,
        300.0,
        "a model served within this long is known: 503, not 404, while it has no worker",
        minimum=0,
    ),
    Option(
        "discovery_silence_s",
        float,
        15.0,
        "etcd silence (no event, progress notification or answered probe) before discovery is reported down",
        minimum=0.1,
    ),
    Option(
        "cache_threshold",
        float,
        0.3,
        "cache_aware: least share of the prompt a worker must already hold to win on its cache",
        minimum=0,
        maximum=1,
    ),
    Option(
        "balance_abs_threshold",
        int,
        64,
        "cache_aware: in-flight gap (max - min) beyond which load wins over cache",
        minimum=0,
    ),
    Option(
        "balance_rel_threshold",
        float,
        1.5,
        "cache_aware: and max > min times this, for load to win over cache",
        minimum=1,
    ),
    Option(
        "max_tree_size",
        int,
        2**26,
        "cache_aware: characters each prefix tree (one per model and role) may hold; least recently used leaves go first",
        minimum=1,
    ),
    Option(
        "kv_events_port",
        int,
        0,
        "kv_aware: the engines' KV-event publisher port on each worker's host (DP rank r at port + r), for workers whose engine does not list its publishers; 0: none",
        minimum=0,
        maximum=65535,
    ),
    Option(
        "kv_events_replay_port",
        int,
        0,
        "kv_aware: the engines' KV-event replay port beside --kv-events-port (rank r at port + r); 0: no replay, a gap leaves the view unknown",
        minimum=0,
        maximum=65535,
    ),
    Option(
        "kv_tokenizer",
        str,
        "",
        "kv_aware: the model's tokenizer.json, or its directory (tokenizer.json, tokenizer_config.json, chat_template.jinja), so completions prompts and /generate text are predicted too, and with a directory chat rendered with the model's chat template as vLLM renders it (needs the tokenizers package, and jinja2 for the chat template)",
    ),
    Option(
        "kv_overlap_weight",
        float,
        2.0,
        "kv_aware: cost of recomputing a typical prompt, in requests in flight (cost = weight x uncached blocks / the typical prompt's blocks + in-flight)",
        minimum=0,
    ),
    Option(
        "kv_token_sources",
        str,
        "tokenizer,model_dir,engine",
        "kv_aware: where a request's token ids come from, tried in this order: tokenizer (--kv-tokenizer), model_dir (the directory the engine reports in /v1/models, when readable here and it tokenizes as the engine does), engine (the engine's /tokenize, asked per request for what the others cannot give); comma-separated, any subset",
    ),
    Option(
        "kv_tokenize_timeout_s",
        float,
        0.5,
        "kv_aware: how long a request waits for an engine's /tokenize before it is placed by load alone",
        minimum=0.01,
    ),
    Option(
        "kv_tokenize_max_concurrent",
        int,
        64,
        "kv_aware: asks of the engines' /tokenize in flight at once; a request past it is placed by load alone instead of waiting",
        minimum=1,
    ),
    Option(
        "engine_load_interval_s",
        float,
        0.5,
        "seconds between readings of each engine's own load (vLLM's /metrics, SGLang's /v1/loads; SGLang's pushed load stream is followed instead where the engine offers one), which least_load, power_of_two, cache_aware and kv_aware add to this process's requests the engine cannot have counted yet; 0: only this process's own count",
        minimum=0,
    ),
    Option(
        "engine_load_timeout_s",
        float,
        1.0,
        "a reading of an engine's load not answered within this is late: the first late one in a row leaves the last reading standing, a second makes its load unknown (this process's own count) until the next answer",
        minimum=0.01,
    ),
    Option(
        "engine_load_window_s",
        float,
        0.25,
        "requests this process sent within this before a reading of the engine's load are presumed not counted in it yet (the engine's intake lag)",
        minimum=0,
    ),
    Option(
        "engine_server_load_interval_s",
        float,
        0.1,
        "seconds between readings of a vLLM engine's /load (the requests its API server holds, counted as they arrive; vLLM answers it when started with its server load tracking flag, enable-server-load-tracking, and /load is used only once it has shown a request: until then, and whenever it fails or stops counting, the load comes from /metrics), for engines of one DP rank; 0: /metrics only",
        minimum=0,
    ),
    Option(
        "engine_server_load_window_s",
        float,
        0.05,
        "as --engine-load-window-s, for readings of vLLM's /load, which counts a request as soon as the engine's handler takes it",
        minimum=0,
    ),
    Option(
        "adapter_list_interval_s",
        float,
        5.0,
        "seconds between readings of each engine's model list for the LoRA adapters it holds (entries with a parent), which requests naming an adapter are planned over; an engine that answers 404 for an adapter it was listed with is read again at once; 0: never read, only the adapters records declare",
        minimum=0,
    ),
    Option(
        "adapter_slot_cost",
        float,
        1.0,
        "least_load, power_of_two and kv_aware: what sending a request for a LoRA adapter to an engine that is not running it but has a free adapter slot (vLLM's max_loras) costs, in requests in flight, against one already running it",
        minimum=0,
    ),
    Option(
        "adapter_wait_cost",
        float,
        4.0,
        "least_load, power_of_two and kv_aware: what sending a request for a LoRA adapter to an engine whose adapter slots all run other adapters (so the request waits for one) costs, in requests in flight",
        minimum=0,
    ),
    Option(
        "spread_margin",
        float,
        0.5,
        "least_load and kv_aware: candidates costing at most this much more than the best (in requests in flight) are drawn at random, so router replicas reading the same loads do not all pick the same engine; 0: the deterministic best",
        minimum=0,
    ),
    Option(
        "policy_seed",
        int,
        -1,
        "seed of this process's random choices (random, power_of_two, the spread among near-equal candidates); -1: drawn from the OS, so replicas and --processes children differ",
        minimum=-1,
    ),
    Option(
        "api_key",
        str,
        "",
        "client key required as `Authorization: Bearer <key>` on the API routes (empty: no check)",
    ),
    Option(
        "api_keys_file",
        str,
        "",
        "YAML mapping of key name to client key, re-read on SIGHUP (empty: none)",
    ),
    Option("protect_metrics", bool, False, "require a client key on /metrics too"),
    Option(
        "worker_api_key",
        str,
        "",
        "key sent to workers as `Authorization: Bearer <key>` (a worker record's api_key wins)",
    ),
    Option(
        "max_concurrent_requests",
        int,
        0,
        "generation requests served at once (0: no limit)",
        minimum=0,
    ),
    Option(
        "queue_size",
        int,
        100,
        "requests that may wait for a slot once the concurrency limit is reached (429 when full)",
        minimum=0,
    ),
    Option(
        "queue_timeout_s",
        float,
        60.0,
        "longest wait in the admission queue (503 queue_timeout after)",
        minimum=0.001,
    ),
    # Traffic policy: priority classes and tenants in the admission queue.
    Option(
        "priority_classes",
        str,
        "",
        "comma-separated priority classes, highest first, e.g. interactive,standard,batch; the admission queue serves higher ones first and a request names its class in x-priority (empty: one class)",
    ),
    Option(
        "default_priority",
        str,
        "",
        "the class of a request whose key names none (required with --priority-classes)",
    ),
    Option(
        "lowest_priority_share",
        float,
        0.0,
        "share of admission slots the lowest class gets while higher ones wait, so it is never starved (0: strict priority)",
        minimum=0,
        maximum=0.9,
    ),
    Option(
        "tenant_header",
        str,
        "",
        "header naming the tenant (its own fair share) of a request no keys-file entry speaks for (empty: the key is the tenant)",
    ),
    Option(
        "tenant_max_inflight",
        int,
        0,
        "requests of one tenant served at once; more wait in the admission queue (0: no cap; a key's max_inflight wins)",
        minimum=0,
    ),
    Option(
        "tenant_max_queued",
        int,
        0,
        "requests of one tenant waiting at once; one more is refused 429 (0: only --queue-size; a key's max_queued wins)",
        minimum=0,
    ),
    Option(
        "admission_metrics_by_tenant",
        bool,
        False,
        "label admission queue depth and wait by client key name too (one series per key in the keys file)",
    ),
    Option(
        "alias_answer_model",
        str,
        "served",
        "the model an answer to an alias names: served (the model that answered, as the worker wrote it) or alias (the name the client sent)",
        ("served", "alias"),
    ),
    Option(
        "engine_priority_scheduling",
        bool,
        False,
        "the engines schedule by priority (vLLM with scheduling policy priority): send each request's class to them as vLLM's priority field (0 for the highest class, 1 for the next, ...)",
    ),
    Option(
        "worker_max_inflight",
        int,
        0,
        "requests in flight per worker (per DP rank when the router picks ranks); a full worker is not a candidate (0: no cap)",
        minimum=0,
    ),
    Option(
        "admin_api_key",
        str,
        "",
        "key of the admin API (POST /v1/workers, drain, DELETE); without it those routes do not exist",
    ),
    Option(
        "otlp_traces_endpoint",
        str,
        "",
        "OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces: one span per request and per attempt (needs the otel extra; empty: no tracing)",
    ),
    Option(
        "wait_for_workers_s",
        float,
        5.0,
        "how long a request waits for an unavailable or departed worker of its model to come back before the 503",
        minimum=0,
    ),
    Option(
        "body_timeout_s",
        float,
        30.0,
        "time for a client to send a whole request body (408 beyond)",
        minimum=0.001,
    ),
    Option(
        "client_write_timeout_s",
        float,
        60.0,
        "longest a client may take no byte of its answer before the request is aborted",
        minimum=0.001,
    ),
    Option(
        "max_buffered_body_bytes",
        int,
        1024**3,
        "request-body bytes buffered at once across all client connections (503 beyond)",
        minimum=1,
    ),
    Option(
        "resume_limit",
        int,
        2,
        "times one stream may go on on another worker when its worker breaks mid-stream, token for token (needs a vLLM worker and the model's tokenizer here: the kv tokenizer, or the engine's model directory when readable); 0: a broken stream ends with the API's error event",
        minimum=0,
        maximum=100,
    ),
    Option(
        "resume_routes",
        str,
        "chat,completions",
        "routes whose streams may resume (comma-separated, of chat and completions; empty: none)",
    ),
    Option(
        "resume_max_ids",
        int,
        65_536,
        "token ids (prompt and answer) kept per resumable stream; a longer one is relayed as it comes and not resumed",
        minimum=1,
    ),
    Option(
        "max_connections_per_worker",
        int,
        256,
        "open upstream connections per worker; a checkout beyond it waits (FIFO) up to the connect timeout, then 503 router_overloaded",
        minimum=1,
    ),
)
