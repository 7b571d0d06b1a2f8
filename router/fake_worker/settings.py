"""The settings of one fake worker: its identity, its shape, its starting behaviour, and
where its KV-event publisher binds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from router.fake_worker.behaviour import Behaviour, FailMode

ENGINES = ("sglang", "vllm")
ROLES = ("mixed", "prefill", "decode")
# SGLang's KV transfer backends, plus "fake" (SGLang's own no-transfer backend for tests).
PD_PROTOCOLS = ("mooncake", "nixl", "ascend", "fake")


@dataclass(frozen=True, slots=True)
class FakeWorkerSettings:
    """Everything `router fake-worker` takes on its command line.

    Identity and shape (`model`, `engine`, `role`, `dp_size`, `pd_protocol`,
    `bootstrap_port`, `max_concurrency`, `startup_delay_s`, `shutdown_grace_s`,
    `cache_tokens`, `prefill_us_per_token`) are fixed for the worker's life;
    the behaviour fields are only the starting point of the live `Behaviour`.
    """

    host: str = "127.0.0.1"
    port: int = 0
    model: str = "fake-model"
    engine: str = "sglang"
    role: str = "mixed"
    dp_size: int = 1
    pd_protocol: str = "mooncake"
    bootstrap_port: int = 8998
    max_concurrency: int = 0
    startup_delay_s: float = 0.0
    shutdown_grace_s: float = 5.0
    tokens: int = 16
    ttft_ms: float = 0.0
    token_latency_ms: float = 0.0
    fail_first: int = 0
    fail_status: int = 503
    fail_mode: FailMode = FailMode.STATUS
    fail_after_chunks: int = 0
    embedding_dim: int = 16
    cache_tokens: int = 0
    prefill_us_per_token: float = 0.0
    max_model_len: int = 2048
    """vLLM's context length (`--engine vllm`): what `/v1/models` and `/tokenize` report and
    the bound on `max_tokens`. 2048 is the tiny model's of the engine tests
    (docs/real-engines.md); `--engine sglang` keeps its own `context_length`."""
    tokenizer: str = ""
    """A model directory (or its tokenizer.json): the prefix cache counts in that model's
    tokens (`router.fake_worker.model_tokens`); empty: the byte rule. Needs the prefix
    cache (`cache_tokens`)."""
    kv_events: bool = False
    """Publish the prefix cache's KV events (`router.fake_worker.kv_publisher`) on two
    ports the kernel picks, listed on `/kv_event_sources`. Needs the prefix cache
    (`cache_tokens`)."""
    kv_events_port: int = 0
    """The KV-event PUB port instead (replay ROUTER at port + 1); implies `kv_events`.
    0: the kernel's choice, when `kv_events` is on."""
    gauge_step_ms: float = 0.0
    """The load gauges (`/metrics`, `/v1/loads`, the load stream) refresh once per
    scheduling step of this length and show what was true at the step before, so a
    reading lags the requests by one to two steps, as an engine's do. 0: live."""
    load_events: bool = False
    """Publish the load as SGLang's `--load-publish-endpoint` does (a ZMQ PUB per DP rank
    on consecutive ports, advertised in `/server_info`'s `kv_events` block); SGLang only."""
    external_load: int = 0
    """Requests another sender holds on this engine, shown in its running gauge (rank 0)
    beside the ones it serves: another router's work, as the gauges would show it."""
    enable_server_load_tracking: bool = False
    """vLLM's flag of the same name: `GET /load` answers the requests in the API server
    (with `external_load`), live; without it, as vLLM does, always 0 (`--engine vllm`)."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters the engine holds at start, as vLLM's `--lora-modules` (`--engine
    vllm` only): listed in `/v1/models` with `parent`, served by name
    (`router.fake_worker.lora`)."""
    max_loras: int = 1
    """Adapters run at once (vLLM's `--max-loras`, default 1); requests for others wait."""
    runtime_lora_updating: bool = False
    """Serve vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, as vLLM does
    with `VLLM_ALLOW_RUNTIME_LORA_UPDATING` (`--engine vllm` only)."""

    @property
    def serves_lora(self) -> bool:
        return bool(self.lora_adapters) or self.runtime_lora_updating

    @property
    def publishes_kv_events(self) -> bool:
        return self.kv_events or self.kv_events_port > 0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.pd_protocol not in PD_PROTOCOLS:
            raise ValueError(
                f"pd_protocol must be one of {', '.join(PD_PROTOCOLS)}, got {self.pd_protocol!r}"
            )
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.max_concurrency < 0:
            raise ValueError(f"max_concurrency must be >= 0, got {self.max_concurrency}")
        if self.startup_delay_s < 0:
            raise ValueError(f"startup_delay_s must be >= 0, got {self.startup_delay_s}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if not 1 <= self.embedding_dim <= 65536:
            raise ValueError(f"embedding_dim must be between 1 and 65536, got {self.embedding_dim}")
        if self.cache_tokens < 0:
            raise ValueError(f"cache_tokens must be >= 0, got {self.cache_tokens}")
        if not 0 <= self.kv_events_port <= 65534:
            raise ValueError(
                f"kv_events_port must be between 0 and 65534, got {self.kv_events_port}"
            )
        if self.tokenizer and not self.cache_tokens:
            raise ValueError("tokenizer needs a prefix cache: set cache_tokens")
        if self.tokenizer and not Path(self.tokenizer).exists():
            raise ValueError(f"tokenizer {self.tokenizer}: no such file or directory")
        if self.publishes_kv_events and not self.cache_tokens:
            what = "kv_events_port" if self.kv_events_port else "kv_events"
            raise ValueError(f"{what} needs a prefix cache: set cache_tokens")
        if not self.gauge_step_ms >= 0:
            raise ValueError(f"gauge_step_ms must be >= 0, got {self.gauge_step_ms}")
        if self.load_events and self.engine != "sglang":
            raise ValueError("load_events is SGLang's load stream: it needs engine sglang")
        if self.enable_server_load_tracking and self.engine != "vllm":
            raise ValueError("enable_server_load_tracking is vLLM's /load: it needs engine vllm")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not self.prefill_us_per_token >= 0:
            raise ValueError(f"prefill_us_per_token must be >= 0, got {self.prefill_us_per_token}")
        if not self.model:
            raise ValueError("model must not be empty")
        if self.serves_lora and self.engine != "vllm":
            raise ValueError("LoRA adapters are served as vLLM serves them: they need engine vllm")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.model in self.lora_adapters:
            raise ValueError(f"adapter {self.model!r} has the base model's name")
        # Fails early, with the same messages as POST /debug/behaviour.
        self.behaviour()

    def behaviour(self) -> Behaviour:
        """A fresh live behaviour starting from these settings."""
        return Behaviour(
            tokens=self.tokens,
            ttft_ms=self.ttft_ms,
            token_latency_ms=self.token_latency_ms,
            fail_first=self.fail_first,
            fail_status=self.fail_status,
            fail_mode=FailMode(self.fail_mode),
            fail_after_chunks=self.fail_after_chunks,
            external_load=self.external_load,
            lora_adapters=self.lora_adapters,
        )


@dataclass(frozen=True, slots=True)
class KvPublisherSettings:
    """Where the fake's KV-event publisher (`router.fake_worker.kv_publisher`) binds."""

    endpoint: str
    """Where the PUB socket binds, e.g. `tcp://127.0.0.1:5557` (`*` port: any)."""
    replay_endpoint: str | None
    """Where the replay ROUTER binds; None: no replay socket."""
    buffer_steps: int = 10_000
    """Batches kept for replay (vLLM's default)."""
    dp_rank: int = 0
    topic: bytes = b""


def publisher_settings(settings: FakeWorkerSettings) -> KvPublisherSettings:
    """`--kv-events-port P`: PUB on the worker's host at P, replay at P + 1; `--kv-events`
    alone: two ports the kernel picks (ZMQ's `*` port), so no two workers can collide."""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    port = settings.kv_events_port
    return KvPublisherSettings(
        endpoint=f"tcp://{host}:{port or '*'}",
        replay_endpoint=f"tcp://{host}:{port + 1 if port else '*'}",
    )
