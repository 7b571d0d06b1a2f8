"""Every capability a case can need and a plane can declare, with what it means.

A capability is a plain name. A case needs the ones its `requires` lists plus those its
shape implies (`Case.capabilities_needed`); a plane declares the set it has. A case that
needs one the plane lacks is reported `unsupported` there, not run.

Adding a capability is one line here (the loader rejects names it does not know, so a
typo in a case or an adapter cannot make a case silently unsupported everywhere).
"""

from __future__ import annotations

from collections.abc import Mapping

CAPABILITIES: Mapping[str, str] = {
    # Breaker
    "breaker.single_probe": "half-open admits exactly one probe however many requests arrive",
    "breaker.backoff": "a failed probe doubles the cooldown, up to a cap",
    "breaker.all_open_dispatch": "with every candidate open, the leg dispatches anyway",
    "breaker.all_open_reject": "with every candidate open, the leg answers 503",
    # Health
    "health.active": "active health checks whose period and thresholds a case can set",
    # Policies, by their neutral name (`settings.policy` and the per-role policies)
    "policy.round_robin": "round robin",
    "policy.random": "uniform random choice",
    "policy.least_load": "fewest requests in flight",
    "policy.power_of_two": "two random candidates, the less loaded one",
    "policy.consistent_hash": "the same session or prompt lands on the same worker",
    "policy.cache_aware": "the SGLang gateway's cache-aware policy and its threshold flags",
    "policy.kv_aware": "routing by the KV-cache events the engines publish (vLLM's ZMQ events, found on /kv_event_sources)",
    "load.engine": "the load policies read the engines' own running and waiting requests (another router's too), not only the plane's own count, within a second or two of a change",
    "cache_aware.smallest_tree": "cache_aware below its threshold picks the worker whose tree is smallest",
    # Prefill/decode disaggregation
    "pd": "prefill and decode pools, both legs of a request",
    "pd.mixed_fleet": "mixed workers beside prefill and decode ones",
    "pd.bootstrap": "SGLang's handoff: bootstrap host, port and room injected into both legs",
    "pd.nixl": "vLLM's NIXL handoff: prefill first, its kv_transfer_params passed to the decode",
    "dp_rank": "a rank-multiplexed worker gets a rank per request",
    # Routes beyond chat (every plane serves /v1/chat/completions), by `request.route`
    "route.completions": "POST /v1/completions (OpenAI completions)",
    "route.generate": "POST /generate (SGLang's native API)",
    "route.responses": "POST /v1/responses (OpenAI Responses)",
    "route.messages": "POST /v1/messages (Anthropic Messages)",
    "route.embeddings": "POST /v1/embeddings",
    # Limits
    "stream.resume": "a stream whose worker breaks after the first byte goes on on another worker, token for token, as one answer (`settings.resume_limit`)",
    "limits.body_size": "a largest request body a case can set (`settings.max_body_bytes`); over it, 413",
    # Admission
    "auth.client_key": "a client key the plane requires (`Authorization: Bearer`), 401 without it",
    "admission.queue": "a limit on requests served at once with a bounded queue; 429 when it is full",
    "admission.priority": "priority classes in the admission queue: a request claims its class (`request.priority`) and higher classes are admitted first",
    # Model names
    "model.alias": "a public model name (`settings.aliases`) served by the model it names",
    "model.alias_weights": "an alias of several served models splits its requests by weight (a canary)",
    "model.fallback": "a model gives way to its fallbacks (`settings.fallbacks`) when it has no worker that can take the request, never when it is unknown",
    # LoRA adapters
    "lora.adapters": "requests naming a LoRA adapter go only to the engines whose model list names it (vLLM lists each adapter with its parent); an adapter no engine holds is 404",
    "lora.routing_miss": "an engine that answers 404 for an adapter it listed is skipped for another that holds it, before any byte reaches the client",
    "lora.affinity": "among the engines holding an adapter, one running it is preferred over a less loaded one whose adapter slots (vLLM's --max-loras) all run other adapters",
    # Fleet state
    "worker.status": "a worker's own record can say DRAINING, and the plane honours it",
    "discovery.etcd": "the plane follows worker records in etcd",
    "discovery.kubernetes": "the plane follows Pods through the Kubernetes API",
    # Upstream protocol (implied by the fleet a run is on, not by a case)
    "upstream.grpc": "the plane routes to gRPC engines (`grpc://` workers, `--fleet grpc` or "
    "`vllm-grpc`): it tokenizes prompts itself and speaks the engines' gRPC services",
}


def unknown(names: frozenset[str] | set[str]) -> list[str]:
    """The names that are not capabilities, sorted."""
    return sorted(name for name in names if name not in CAPABILITIES)
