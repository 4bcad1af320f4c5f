"""ComputeInstance servicer: thin async handlers over the engine thread (``EngineLoop``).

A Generate stream ends with finish reason, usage and where the request's rBlocks lived. When the caller
goes away (cancellation, deadline) the request is aborted, which frees its rBlocks on every server. A
request with ``first_and_final_only`` streams two messages (:class:`FirstAndFinal`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable

import grpc
from opentelemetry import trace

from infinite_llm.engine import RequestOutput
from infinite_llm.observability.tracing import REQUEST_ID_ATTRIBUTE
from infinite_llm.pb.v1 import compute_instance_pb2 as cpb
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.services.compute.engine_loop import EngineLoop
from infinite_llm.services.generate_codec import prompt_from_request, response_from_output, sampling_from_proto
from infinite_llm.services.prompt_limits import check_prompt_size, encode_off_loop


class FirstAndFinal:
    """A request's sink that passes on its first output and its last, the last carrying every token, text and
    logprob since the first (vLLM's ``RequestOutputKind.FINAL_ONLY``, the first kept so that a caller still
    learns the request started); errors always pass. Called on the engine thread, so the outputs in between
    cost the event loop neither a wake-up nor a message.

    Args:
        post: the sink outputs are passed on to (``RequestOutput`` or an ``Exception``).
    """

    def __init__(self, post: Callable[[RequestOutput | Exception], None]) -> None:
        self.post = post
        self._sent: tuple[int, int, int] | None = None  # tokens, characters, logprobs the first output carried

    def __call__(self, out: RequestOutput | Exception) -> None:
        if isinstance(out, Exception):
            self.post(out)
        elif self._sent is None:
            self._sent = (len(out.token_ids), len(out.text), len(out.logprobs or ()))
            self.post(out)
        elif out.finished:
            tokens, chars, logprobs = self._sent
            self.post(
                dataclasses.replace(
                    out,
                    new_token_ids=out.token_ids[tokens:],
                    new_text=out.text[chars:],
                    new_logprobs=out.logprobs[logprobs:] if out.logprobs is not None else None,
                )
            )


class ComputeInstanceServicer(cgrpc.ComputeInstanceServicer):
    def __init__(self, loop: EngineLoop, instance_id: str, model_name: str, kv=None) -> None:  # noqa: ANN001
        """``kv``: the engine's ``DistAttention`` (placement of finished requests, RPC timings); optional in tests."""
        self.loop = loop
        self.kv = kv
        self.instance_id = instance_id
        self.model_name = model_name
        self._placement_of = kv.pop_placement if kv is not None else (lambda _rid: {})
        self._live: set[str] = set()

    async def Generate(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        params = sampling_from_proto(request.sampling)
        prompt = prompt_from_request(request)
        if isinstance(prompt, str):  # capped, then tokenized on a worker thread: not on the engine's
            engine = self.loop.engine
            check_prompt_size(prompt, engine.model_config.max_position_embeddings)
            prompt = await encode_off_loop(engine.tokenizer, prompt)
        rid = request.request_id or f"cmpl-{uuid.uuid4().hex}"
        trace.get_current_span().set_attribute(REQUEST_ID_ATTRIBUTE, rid)
        aio_loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()

        def post(out: RequestOutput | Exception) -> None:
            aio_loop.call_soon_threadsafe(outputs.put_nowait, out)

        self.loop.submit(rid, prompt, params, FirstAndFinal(post) if request.first_and_final_only else post)
        self._live.add(rid)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, Exception):
                    finished = True  # the engine already dropped it
                    raise out
                finished = out.finished
                yield response_from_output(out, self._placement_of(rid) if finished else None)
        finally:
            self._live.discard(rid)
            if not finished:
                self.loop.abort(rid)  # the caller went away: free the request's rBlocks everywhere

    async def Abort(self, request: gpb.AbortRequest, context: grpc.aio.ServicerContext) -> gpb.AbortResponse:  # noqa: N802
        known = request.request_id in self._live
        if known:
            self.loop.abort(request.request_id)
        return gpb.AbortResponse(aborted=known)

    async def GetStats(self, request: cpb.ComputeStatsRequest, context) -> cpb.ComputeStatsResponse:  # noqa: N802, ANN001
        return cpb.ComputeStatsResponse(
            instance_id=self.instance_id,
            num_running=self.loop.num_running,
            num_waiting=self.loop.num_waiting,
            num_preemptions=self.loop.engine.num_preemptions,
            generated_tokens=self.loop.generated_tokens,
            model=self.model_name,
            layer_rpc_seconds=getattr(self.kv, "fan_out_seconds", 0.0),
            layer_rpc_count=getattr(self.kv, "fan_out_count", 0),
            server_rpc_seconds=dict(getattr(self.kv, "rpc_seconds", {})),
            prefix_cache_queries=getattr(self.kv, "prefix_cache_queries", 0),
            prefix_cache_hits=getattr(self.kv, "prefix_cache_hits", 0),
        )
