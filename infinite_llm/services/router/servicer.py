"""Router servicer: the public gRPC API. Validates, picks the least-loaded compute instance, relays tokens.

Compute instances are static addresses (``--compute``, a ``dns:///`` headless Service among them) and those
the manager lists (:mod:`.discovery` calls :meth:`RouterServicer.set_discovered`): an instance that joins
takes requests from then on, one that leaves takes no new ones while its running streams finish. Among
the least loaded (fewest requests in flight through this router), turns rotate.

Deadlines travel downstream (the compute call gets what is left of the caller's); a caller that goes away
cancels the compute call, which aborts the request and frees its rBlocks. A compute instance that is
unreachable before any token was sent (it died, or its queue is full) is skipped for the next one, under a
fresh downstream request id (the dead one's rBlocks and ledger entry stay its own until the manager reclaims
them; the caller still sees its id); after that the stream fails with UNAVAILABLE (nothing hangs). A request
id already in flight here is refused. A stopping router whose grace runs out ends the streams still in flight
itself (:meth:`RouterServicer.end_in_flight`): UNAVAILABLE with the reason, and their compute calls cancelled,
rather than gRPC's bare CANCELLED "Cancelling all calls".
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from infinite_llm.core.errors import (
    CapacityExhausted,
    InfiniteLLMError,
    InvalidRequest,
    ModelNotFound,
    QueueFull,
    Unavailable,
)
from infinite_llm.core.ids import check_id
from infinite_llm.observability.metrics import RouterMetrics
from infinite_llm.observability.tracing import REQUEST_ID_ATTRIBUTE
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.pb.v1 import router_pb2 as rpb
from infinite_llm.pb.v1 import router_pb2_grpc as rgrpc
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.rpc.errors import error_from_rpc
from infinite_llm.rpc.interceptors.api_key import tenant_of
from infinite_llm.services.generate_codec import prompt_from_request, sampling_from_proto
from infinite_llm.services.prompt_limits import check_prompt_size, encode_off_loop

DEFAULT_TIMEOUT_S = 600.0  # a generation without a client deadline gets this long (seconds)


class _Instance:
    def __init__(self, address: str, instance_id: str = "") -> None:
        self.address = address
        self.instance_id = instance_id or address
        # round_robin: a dns:/// address naming several pods (a headless Service) spreads requests over all
        # of them; a plain host:port is one instance either way.
        self.channel = aio_channel(
            address, timeout_s=DEFAULT_TIMEOUT_S, extra_options=[("grpc.lb_policy_name", "round_robin")]
        )
        self.stub = cgrpc.ComputeInstanceStub(self.channel)
        self.in_flight = 0
        self.retired = False  # the manager no longer lists it: no new requests; closed when idle


class RouterServicer(rgrpc.RouterServicer):
    def __init__(
        self,
        compute_addresses: list[str],
        model_name: str,
        max_model_len: int,
        tokenizer,  # noqa: ANN001
        metrics: RouterMetrics | None = None,
    ) -> None:
        """``compute_addresses``: static instances; more come from :meth:`set_discovered`."""
        self._static = [_Instance(a) for a in compute_addresses]
        self._discovered: dict[str, _Instance] = {}
        self._turns = itertools.count()
        self._closing: set[asyncio.Task] = set()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        # request id -> (its instance, its tenant, the id it has there, the call to it)
        self._owner: dict[str, tuple[_Instance, str, str, grpc.aio.UnaryStreamCall]] = {}
        self._ending = ""  # why every stream in flight is being ended ('' while serving)
        self.metrics = metrics or RouterMetrics(CollectorRegistry())

    # ---- compute instances --------------------------------------------------------------------------
    @property
    def instances(self) -> list[_Instance]:
        """The instances new requests may go to: static ones, then the discovered ones."""
        return [*self._static, *self._discovered.values()]

    def set_discovered(self, live: dict[str, str]) -> None:
        """Follow the manager's list, ``{address: instance_id}`` (on the event loop). New addresses take
        requests from now on; gone ones take no new requests, and their channel closes after their last one."""
        for address in set(self._discovered) - set(live):
            inst = self._discovered.pop(address)
            inst.retired = True
            self._close_if_idle(inst)
        static = {i.address for i in self._static}
        for address, instance_id in live.items():
            if address in self._discovered:
                self._discovered[address].instance_id = instance_id  # another instance took over the port
            elif address not in static:
                self._discovered[address] = _Instance(address, instance_id)

    def _close_if_idle(self, inst: _Instance) -> None:
        if inst.retired and inst.in_flight == 0:
            task = asyncio.get_running_loop().create_task(inst.channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    # ---- generation ---------------------------------------------------------------------------------
    def _validate(self, request: gpb.GenerateRequest) -> gpb.GenerateRequest:
        if request.model and request.model != self.model_name:
            raise ModelNotFound(f"model {request.model!r} is not served here; try {self.model_name!r}", param="model")
        if request.request_id:  # before anything else: a bad id must not reach a compute instance or etcd
            check_id("request_id", request.request_id)
        sampling_from_proto(request.sampling)  # raises InvalidRequest naming the bad parameter
        prompt = prompt_from_request(request)
        if not prompt:
            raise InvalidRequest("prompt is empty", param="prompt")
        check_prompt_size(prompt, self.max_model_len)  # before a compute instance tokenizes it
        out = gpb.GenerateRequest()
        out.CopyFrom(request)
        out.request_id = request.request_id or f"cmpl-{uuid.uuid4().hex}"
        return out

    def _pick(self, tried: set[str], last_error: InfiniteLLMError | None = None, last_address: str = "") -> _Instance:
        """The least loaded instance not ``tried`` yet (ties: the next in turn).

        Raises:
            CapacityExhausted: ``last_error``, when every instance was tried and the last one was full.
            Unavailable: none is registered, or every one was tried; then it names the last one tried and
                what it answered (``last_error``), so the cause (no attention server registered yet, a
                failover) reaches the caller.
        """
        candidates = [i for i in self.instances if i.address not in tried]
        if not candidates:
            if isinstance(last_error, CapacityExhausted):
                raise last_error
            if not tried:
                raise Unavailable("no compute instance is registered with the manager (or given with --compute)")
            why = f"; the last one tried ({last_address}) answered: {last_error.message}" if last_error else ""
            raise Unavailable(f"no compute instance could take the request (tried {len(tried)}){why}")
        turn = next(self._turns) % len(candidates)
        return min(candidates[turn:] + candidates[:turn], key=lambda i: i.in_flight)  # ties: the next in turn

    async def _relay(
        self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gpb.GenerateResponse]:
        status = "cancelled"
        try:
            async for msg in self._relay_once(request, context):
                self.metrics.generation_tokens.inc(len(msg.token_ids))
                yield msg
            status = "ok"
        except InfiniteLLMError as e:
            status = e.grpc_code.lower()
            raise
        finally:
            self.metrics.requests.labels(status=status).inc()

    async def _relay_once(
        self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gpb.GenerateResponse]:
        request = self._validate(request)
        rid = request.request_id
        trace.get_current_span().set_attribute(REQUEST_ID_ATTRIBUTE, rid)
        if rid in self._owner:
            raise InvalidRequest(f"request id {rid[:64]!r} is already in flight", param="request_id")
        remaining = context.time_remaining()
        timeout = DEFAULT_TIMEOUT_S if remaining is None else max(remaining, 0.001)
        tried: set[str] = set()
        last_error: InfiniteLLMError | None = None
        last_address = ""
        while True:
            inst = self._pick(tried, last_error, last_address)
            if tried:  # a retry: the instance that failed may still hold the old id's rBlocks
                request.request_id = f"{rid[:200]}:retry-{uuid.uuid4().hex[:12]}"
            tried.add(inst.address)
            call = inst.stub.Generate(request, timeout=timeout)
            inst.in_flight += 1
            self.metrics.in_flight.labels(instance=inst.address).set(inst.in_flight)
            self._owner[rid] = (inst, tenant_of(context), request.request_id, call)
            sent = False
            try:
                async for msg in call:
                    sent = True
                    msg.request_id = rid
                    yield msg
                return
            except (grpc.RpcError, asyncio.CancelledError) as e:
                if self._ending and call.cancelled():  # end_in_flight cancelled it
                    raise Unavailable(self._ending) from None
                if isinstance(e, asyncio.CancelledError):
                    raise
                # Before any token, an instance that is gone or whose queue is full is skipped for the next;
                # when every one was, the caller gets the last refusal (UNAVAILABLE, or RESOURCE_EXHAUSTED).
                error = error_from_rpc(e)
                if not sent and isinstance(error, Unavailable | QueueFull):
                    last_error, last_address = error, inst.address
                    continue
                if sent and isinstance(error, Unavailable):  # tokens went out: no other instance may take it over
                    raise Unavailable(
                        f"compute instance {inst.address} failed after the request's first tokens ({error.message}); "
                        "the output so far is partial: send the request again"
                    ) from None
                raise error from None
            finally:
                call.cancel()  # no-op when finished; frees the request downstream when the caller left
                inst.in_flight -= 1
                self.metrics.in_flight.labels(instance=inst.address).set(inst.in_flight)
                self._owner.pop(rid, None)
                self._close_if_idle(inst)

    def end_in_flight(self, reason: str) -> int:
        """End every generation in flight with UNAVAILABLE ``reason`` (a stopping router whose grace ran out):
        each compute call is cancelled, which aborts its request there and frees its rBlocks. Returns how many."""
        self._ending = reason
        calls = [owned[3] for owned in self._owner.values()]
        for call in calls:
            call.cancel()
        return len(calls)

    async def GenerateStream(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        async for msg in self._relay(request, context):
            yield msg

    async def Generate(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext) -> gpb.GenerateResponse:  # noqa: N802
        """The whole completion in one reply. The compute instance streams it as two messages (the first token,
        then the rest: ``first_and_final_only``), not one per token: the first still tells a retry that the
        request started there."""
        request.first_and_final_only = True
        total = gpb.GenerateResponse()
        async for msg in self._relay(request, context):
            total.request_id = msg.request_id
            total.token_ids.extend(msg.token_ids)
            total.text += msg.text
            total.logprobs.extend(msg.logprobs)
            total.prompt_logprobs.extend(msg.prompt_logprobs)
            if msg.finish_reason:
                total.finish_reason = msg.finish_reason
                total.usage.CopyFrom(msg.usage)
                total.placement.extend(msg.placement)
                total.num_preemptions = msg.num_preemptions
        return total

    async def Abort(self, request: gpb.AbortRequest, context: grpc.aio.ServicerContext) -> gpb.AbortResponse:  # noqa: N802
        """Abort a request of the caller's own (same certificate identity and API key); another tenant's
        request reads as unknown (``aborted=False``), so ids cannot be probed either. A malformed id is
        INVALID_ARGUMENT, as in ``Generate``."""
        check_id("request_id", request.request_id)
        owned = self._owner.get(request.request_id)
        if owned is None or owned[1] != tenant_of(context):
            return gpb.AbortResponse(aborted=False)
        inst, _, downstream_id, _ = owned
        try:
            return await inst.stub.Abort(gpb.AbortRequest(request_id=downstream_id), timeout=10)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    # ---- metadata -----------------------------------------------------------------------------------
    async def ListModels(self, request: rpb.ListModelsRequest, context) -> rpb.ListModelsResponse:  # noqa: N802, ANN001
        card = rpb.ModelCard(id=self.model_name, max_model_len=self.max_model_len, owned_by="infinite-llm")
        return rpb.ListModelsResponse(models=[card])

    async def Tokenize(self, request: rpb.TokenizeRequest, context) -> rpb.TokenizeResponse:  # noqa: N802, ANN001
        if request.model and request.model != self.model_name:
            raise ModelNotFound(f"model {request.model!r} is not served here", param="model")
        check_prompt_size(request.text, self.max_model_len, param="text")
        ids = await encode_off_loop(self.tokenizer, request.text, request.add_special_tokens)
        return rpb.TokenizeResponse(token_ids=ids)
