"""`router fake-worker`: a GPU-free engine for tests, demos, conformance runs and benchmarks, speaking the APIs of SGLang and vLLM with their metric names, or vLLM's gRPC engine service (`grpc_engine`, `--protocol grpc`); only the inference is fake."""

from router.fake_worker.engine import serve_fake_worker
from router.fake_worker.settings import FakeWorkerSettings

__all__ = ["FakeWorkerSettings", "serve_fake_worker"]
