"""A router for LLM inference fleets, on trio.

The packages are layers. Each imports only from the layers listed before it, never from
one after it, so the order below is also the order a reader can learn them in
(`tests/test_layout.py` holds the imports to it):

    http           bytes on sockets: the client-facing server and the upstream pool,
                   two halves that never import each other; and what the httpx clients
                   off the request path share (capped reads, retry backoff)
    api            the routes table, the one error tree, each API's error shape
    fleet          worker records, the registry and its load, DP ranks, the breaker,
                   active health checks
    observability  metrics, tracing, request ids
    engines        what engines say of themselves: the facts a record leaves open, the
                   models they serve, their metrics and load, their KV-cache events and
                   the block index built from them
    discovery      static, etcd and Kubernetes fleets
    prompts        a request's prompt as the engine sees it: chat templates rendered as
                   the engines render them, the model's tokenizer
    policies       the choice among a leg's candidates, and the keys it reads
    pipeline       one request: resolve, plan, wait, attempt, strategies, dispatch, relay
    edge           the app in front of the pipeline: client keys, admission, admin API
    agent          beside an engine: registration and drain
    fake_worker    the GPU-free engine
    cli            the entry points, which wire all of the above
"""

__version__ = "0.1.0"

LAYERS = (
    "http",
    "api",
    "fleet",
    "observability",
    "engines",
    "discovery",
    "prompts",
    "policies",
    "pipeline",
    "edge",
    "agent",
    "fake_worker",
    "cli",
)
