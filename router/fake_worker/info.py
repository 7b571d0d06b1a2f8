"""The read-only engine endpoints a gateway calls when it admits a worker.

The SGLang Model Gateway, on `--worker-urls`, waits for `/health` 200, reads `/v1/models`
(its `owned_by` names the engine: "sglang" or "vllm"), then `/server_info` (falling back to
`/get_server_info` on 404) for `dp_size`, the model and `max_running_requests`, and
`/model_info` (or `/get_model_info`). For load it tries `/v1/loads` first, then `/metrics`.

What tells the engines apart is served as each engine serves it: `--engine sglang` answers
both server-info paths (SGLang's server arguments and `version`); `--engine vllm` answers
neither (404), `/version` as vLLM does (`{"version": ...}` and nothing else) and
`/kv_event_sources` as vLLM 0.32 does: its events config by DP rank while it publishes
(`--kv-events-port` with a prefix cache), `{}` while it does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from router.fake_worker.settings import FakeWorkerSettings, publisher_settings
from router.fake_worker.stats import RankLoad

FAKE_VERSION = "0.0.0+fake"
CONTEXT_LENGTH = 32768
# What a full KV cache means when --max-concurrency does not say: requests per rank.
DEFAULT_CAPACITY = 256


def capacity(settings: FakeWorkerSettings) -> int:
    return settings.max_concurrency or DEFAULT_CAPACITY


def model_root(settings: FakeWorkerSettings) -> str:
    """The model's `root` in `/v1/models`: the `--tokenizer` directory, absolute, when the
    fake has one, else the model id (as vLLM reports a model named by its hub id)."""
    if settings.tokenizer:
        path = Path(settings.tokenizer).resolve()
        return str(path if path.is_dir() else path.parent)
    return settings.model


def models(settings: FakeWorkerSettings) -> dict[str, Any]:
    """`GET /v1/models`: the one served model."""
    return {
        "object": "list",
        "data": [
            {
                "id": settings.model,
                "object": "model",
                "created": 0,
                "owned_by": settings.engine,
                # vLLM's root is the directory it loaded: the fake's model tokens come from
                # its --tokenizer directory, so that one (a router on the same host reads it).
                "root": model_root(settings),
                "max_model_len": CONTEXT_LENGTH,
            }
        ],
    }


def version() -> dict[str, Any]:
    """`GET /version`, in vLLM's shape (an object with `version` only)."""
    return {"version": FAKE_VERSION}


def kv_event_sources(
    settings: FakeWorkerSettings, bound: tuple[str, str | None] | None = None
) -> dict[str, Any]:
    """`GET /kv_event_sources` (vLLM only): the publishers by DP rank, each as vLLM
    serializes its `KVEventsConfig`; `{}` without `--kv-events-port`, as vLLM answers
    without `--kv-events-config`. The fake's one publisher is rank 0's, whatever
    `--dp-size` says. A worker bound on every interface lists a `*` host, as vLLM's
    config says it; the reader puts the worker's own host in its place.

    `bound`: the publisher's endpoints as bound (the ports the kernel picked); without
    them only fixed ports (`--kv-events-port`) can be listed, and kernel-picked ones that
    are not bound yet are not listed at all."""
    if not settings.publishes_kv_events:
        return {}
    publisher = publisher_settings(settings)
    if bound is not None:
        endpoints = [bound[0], bound[1] or ""]
    elif settings.kv_events_port:
        endpoints = [publisher.endpoint, publisher.replay_endpoint or ""]
    else:
        return {}
    if settings.host in ("", "0.0.0.0", "::"):
        endpoints = [
            f"tcp://*:{endpoint.rsplit(':', 1)[1]}" if endpoint else "" for endpoint in endpoints
        ]
    return {
        str(publisher.dp_rank): {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoints[0],
            "replay_endpoint": endpoints[1],
            "buffer_steps": publisher.buffer_steps,
            "hwm": 100_000,
            "max_queue_size": 100_000,
            "topic": publisher.topic.decode(),
        }
    }


def model_info(settings: FakeWorkerSettings) -> dict[str, Any]:
    """`GET /get_model_info` and `/model_info`."""
    return {
        "model_path": settings.model,
        "tokenizer_path": settings.model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "fake",
        "architectures": ["FakeForCausalLM"],
    }


def server_info(
    settings: FakeWorkerSettings,
    port: int,
    loads: Sequence[RankLoad],
    load_port_base: int | None = None,
) -> dict[str, Any]:
    """`GET /get_server_info` and `/server_info`: SGLang's server args, scheduler facts,
    per-rank internal states and version (a subset of SGLang's few hundred fields), and
    with a load stream (`load_port_base`), the `kv_events` block that advertises it."""
    return {
        "kv_events": None
        if load_port_base is None
        else {
            "publisher": "zmq",
            "endpoint_host": "*",
            "topic": "kv",
            "dp_size": settings.dp_size,
            "load_endpoint_port_base": load_port_base,
            "load_topic": "load",
        },
        "model_path": settings.model,
        "served_model_name": settings.model,
        "tokenizer_path": settings.model,
        "host": settings.host,
        "port": port,
        "tp_size": 1,
        "dp_size": settings.dp_size,
        "pp_size": 1,
        "load_balance_method": "round_robin",
        "disaggregation_mode": "null" if settings.role == "mixed" else settings.role,
        "disaggregation_transfer_backend": settings.pd_protocol,
        "disaggregation_bootstrap_port": settings.bootstrap_port,
        "max_running_requests": settings.max_concurrency or None,
        "context_length": CONTEXT_LENGTH,
        "max_total_num_tokens": capacity(settings) * CONTEXT_LENGTH,
        "is_embedding": False,
        "internal_states": [
            {"dp_rank": rank, "num_running_reqs": load.running, "num_waiting_reqs": load.queued}
            for rank, load in enumerate(loads)
        ],
        "version": FAKE_VERSION,
    }


def loads(settings: FakeWorkerSettings, loads: Sequence[RankLoad]) -> dict[str, Any]:
    """`GET /v1/loads` and `/loads`: one snapshot per DP rank, in the gateway's load schema."""
    cap = capacity(settings)
    snapshots = []
    for rank, load in enumerate(loads):
        usage = min(1.0, load.running / cap)
        snapshots.append(
            {
                "dp_rank": rank,
                "num_running_reqs": load.running,
                "num_waiting_reqs": load.queued,
                "num_waiting_uncached_tokens": 0,
                "num_total_reqs": load.running + load.queued,
                "num_used_tokens": int(usage * cap * CONTEXT_LENGTH),
                "max_total_num_tokens": cap * CONTEXT_LENGTH,
                "token_usage": usage,
                "gen_throughput": 0.0,
                "cache_hit_rate": 0.0,
                "utilization": usage,
                "max_running_requests": settings.max_concurrency,
            }
        )
    return {"timestamp": "", "dp_rank_count": len(snapshots), "loads": snapshots}


def legacy_load(loads: Sequence[RankLoad]) -> list[dict[str, Any]]:
    """`GET /get_load`, the older SGLang shape: a list with one entry per DP rank."""
    return [
        {
            "dp_rank": rank,
            "num_reqs": load.running + load.queued,
            "num_waiting_reqs": load.queued,
            "num_tokens": 0,
        }
        for rank, load in enumerate(loads)
    ]
