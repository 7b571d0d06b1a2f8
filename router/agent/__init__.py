"""`router agent`: beside an engine, it waits for the engine's health, registers the worker in etcd, keeps the lease alive, and on SIGTERM announces DRAINING, waits for the engine to go idle and deregisters."""

from router.agent.advertise import (
    advertised_url,
    etcd_endpoint_url,
    loopback_warning,
    worker_record,
)
from router.agent.drain import DrainSettings, read_engine_load
from router.agent.registration import DEFAULT_LEASE_TTL_S, DEFAULT_PREFIX, run_registered

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_PREFIX",
    "DrainSettings",
    "advertised_url",
    "etcd_endpoint_url",
    "loopback_warning",
    "read_engine_load",
    "run_registered",
    "worker_record",
]
