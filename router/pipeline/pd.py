"""The PD strategy: the handoff fields and rooms, and the two-leg attempt (a prefill and a decode).

The handoff must be right by construction: a malformed one does not fail fast in a real
engine, it hangs far from the router. So both legs get the same body, built once here.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any, Final
from urllib.parse import urlsplit

import trio

from router.api.errors import BadRequest
from router.fleet.records import Role
from router.fleet.registry import Worker
from router.http import clock
from router.observability.metrics import PipelineMetrics
from router.observability.request_id import current_request_id
from router.pipeline.attempt import AttemptRunner, Lease, RequestContext, WorkerFailed
from router.pipeline.handoff_body import UnspliceableBody, splice_handoff
from router.pipeline.plan import Plan
from router.pipeline.resolve import GenerationRequest

log: Final = logging.getLogger("router.pd")

ROOM_LIMIT: Final = 1 << 63
DEFAULT_BOOTSTRAP_PORT: Final = 8998  # SGLang's default disaggregation bootstrap port


def bootstrap_address(prefill: Worker) -> tuple[str, int]:
    """Where a decode pulls this prefill's KV cache from.

    The advertised `disagg_meta.params.bootstrap_addr` (`host:port`, `[v6]:port`) wins;
    a part it leaves out, or cannot say (an unparseable port), comes from the prefill
    URL's host and SGLang's default bootstrap port.
    """
    host = urlsplit(prefill.url).hostname or "127.0.0.1"
    port = DEFAULT_BOOTSTRAP_PORT
    addr = prefill.record.bootstrap_addr
    if addr:
        try:
            advertised = urlsplit("//" + addr.strip())
            advertised_port = advertised.port
        except ValueError:
            return host, port
        host = advertised.hostname or host
        port = advertised_port or port
    return host, port


def make_room(rng: random.Random, dp_size: int, rank: int | None) -> int:
    """A random 63-bit room; with a router-chosen prefill rank, `room % dp_size == rank`
    (SGLang routes the handoff to the rank the room names, and a room that names another
    rank hangs the transfer instead of failing it)."""
    if rank is not None and not 0 <= rank < dp_size:
        raise ValueError(f"rank {rank} is outside dp_size {dp_size}")
    room = rng.getrandbits(63)
    if rank is None or dp_size <= 1:
        return room
    room = room - room % dp_size + rank
    if room >= ROOM_LIMIT:
        room -= dp_size
    return room


def batch_size(generation: GenerationRequest) -> int | None:
    """How many rooms the request needs: one per prompt of a batch, one per choice of n > 1;
    None for a single sequence (scalar handoff fields).

    Never a scalar room for several sequences: SGLang spreads a scalar room over them as
    `room + i`, and every room but the first then names another DP rank. A batch's list
    has one room per prompt; SGLang repeats it for each of a prompt's choices.
    """
    body = generation.body
    prompts: Any = None
    n: Any = body.get("n")
    if generation.route == "completions":
        prompts = body.get("prompt")
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
            prompts = None  # one prompt given as token ids
    elif generation.route == "generate":
        prompts = body.get("text")
        if prompts is None:
            ids = body.get("input_ids")
            prompts = ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else None
        sampling = body.get("sampling_params")
        n = sampling.get("n") if isinstance(sampling, dict) else None
    if isinstance(prompts, list):
        return len(prompts)
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return n
    return None


def handoff_fields(
    generation: GenerationRequest, prefill: Worker, prefill_rank: int | None, rng: random.Random
) -> dict[str, Any]:
    """The SGLang handoff both legs' bodies carry: scalars for one sequence, equal-length
    lists (one room per prompt or choice) for a batch, and `disagg_prefill_dp_rank` when
    the router chose the prefill's rank."""
    host, port = bootstrap_address(prefill)
    size = batch_size(generation)
    dp_size = prefill.record.dp_size

    fields: dict[str, Any]
    if size is None:
        fields = {
            "bootstrap_host": host,
            "bootstrap_port": port,
            "bootstrap_room": make_room(rng, dp_size, prefill_rank),
        }
    else:
        fields = {
            "bootstrap_host": [host] * size,
            "bootstrap_port": [port] * size,
            "bootstrap_room": [make_room(rng, dp_size, prefill_rank) for _ in range(size)],
        }
    if prefill_rank is not None:
        fields["disagg_prefill_dp_rank"] = prefill_rank
    return fields


def check_batch(generation: GenerationRequest, max_n: int) -> None:
    """Refuse (400) a request that would need more than `max_n` rooms, before any list is built."""
    size = batch_size(generation)
    if size is not None and size > max_n:
        raise BadRequest(
            f"this request needs {size} prefill/decode handoffs (one per prompt or choice); "
            f"the limit is {max_n} (--max-n)"
        )


def pd_body(generation: GenerationRequest, fields: dict[str, Any]) -> bytes:
    """Both legs' body: the client's bytes with `fields` spliced in (see router.pipeline.handoff_body).
    A body that cannot be spliced is the client's: 400, never 500."""
    try:
        return splice_handoff(generation.raw, generation.body, fields)
    except UnspliceableBody as exc:
        raise BadRequest(f"request body cannot carry the prefill/decode handoff: {exc}") from None


class PDStrategy:
    """One PD attempt: a prefill and a decode chosen independently, dispatched together."""

    def __init__(
        self,
        runner: AttemptRunner,
        pipeline_metrics: PipelineMetrics,
        max_n: int,
        rng: random.Random | None = None,
    ) -> None:
        self.runner = runner
        self.pipeline_metrics = pipeline_metrics
        self.max_n = max_n
        self.rng = rng or random.Random()

    async def attempt(self, plan: Plan, ctx: RequestContext) -> int | None:
        """One pair, or None when a leg has no untried candidate left.

        A pre-first-byte failure of either leg cancels the other and raises WorkerFailed:
        only the failing worker records the fault and joins its leg's tried set, so the
        next attempt pairs a new worker for that leg with any partner, including this one.
        Cancellation (client gone): both upstream connections close, both permits are
        released without a verdict, both in-flight counts drop. Raises BadRequest, before
        any lease is taken, for a batch beyond `--max-n` or a body the handoff cannot be
        spliced into. Every lease taken is released on every path.
        """
        runner = self.runner
        generation = ctx.generation
        check_batch(generation, self.max_n)
        prefill_pick = runner.pick(plan, Role.PREFILL, ctx)
        decode_pick = runner.pick(plan, Role.DECODE, ctx)
        if prefill_pick is None or decode_pick is None:
            return None
        (prefill, prefill_rank), (decode, decode_rank) = prefill_pick, decode_pick
        # Everything that can fail on the client's input runs before a lease is taken.
        raw = pd_body(generation, handoff_fields(generation, prefill, prefill_rank, self.rng))
        now = clock.now()
        leases: list[Lease] = []
        status: int | None = None
        try:
            prefill_lease = runner.take(
                prefill, plan.legs[Role.PREFILL].forced, now, prefill_rank, leases
            )
            decode_lease = runner.take(
                decode, plan.legs[Role.DECODE].forced, now, decode_rank, leases
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._prefill_leg, prefill_lease, decode_lease, raw, ctx)
                try:
                    status = await runner.exchange(decode_lease, raw, ctx)
                except WorkerFailed:
                    self.pipeline_metrics.count_leg_failure(Role.DECODE)
                    raise
        except BaseExceptionGroup as group:
            raise _one_exception(group) from None
        finally:
            runner.release_all(leases)
        return status

    async def _prefill_leg(
        self, lease: Lease, decode_lease: Lease, raw: bytes, ctx: RequestContext
    ) -> None:
        """Send the prefill request, read its answer and discard it.

        Its failure cancels the decode leg only while nothing reached the client; after
        that the decode's own stream says how the generation ended. Cancellation: the
        upstream connection closes and the lease records no verdict.
        """
        try:
            await self.runner.consume(lease, raw, ctx)
        except WorkerFailed as failed:
            self.pipeline_metrics.count_leg_failure(Role.PREFILL)
            if decode_lease.committed:
                answer = failed.failure.answer
                if not failed.failure.retryable and answer is not None and answer.status < 500:
                    # The client's own mistake (say `"max_new_tokens": -5`), which the
                    # decode answered too: nothing failed, as a mixed worker's 400 is none.
                    log.debug(
                        "prefill %s refused the request with %d, as the decode did [request %s]",
                        failed.worker.id,
                        answer.status,
                        current_request_id(),
                    )
                    return
                log.warning(
                    "prefill %s failed after the decode answered: %s [request %s]",
                    failed.worker.id,
                    failed.failure.detail,
                    current_request_id(),
                )
                return
            raise


def _one_exception(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one error a PD attempt reports: cancellation first (trio must see it), then a
    leg's WorkerFailed, then anything else (e.g. the client leaving)."""
    leaves = list(_leaves(group))
    for leaf in leaves:
        if isinstance(leaf, trio.Cancelled):
            return group
    for leaf in leaves:
        if isinstance(leaf, WorkerFailed):
            return leaf
    return leaves[0]


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
