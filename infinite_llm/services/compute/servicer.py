"""ComputeInstance servicer: thin async handlers over the engine thread (``EngineLoop``).

A Generate stream ends with finish reason, usage and where the request's rBlocks lived. When the caller
goes away (cancellation, deadline) the request is aborted, which frees its rBlocks on every server.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc

from infinite_llm.engine import RequestOutput
from infinite_llm.pb.v1 import compute_instance_pb2 as cpb
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.services.compute.engine_loop import EngineLoop
from infinite_llm.services.generate_codec import prompt_from_request, response_from_output, sampling_from_proto
from infinite_llm.services.prompt_limits import check_prompt_size, encode_off_loop


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
        aio_loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.loop.submit(rid, prompt, params, lambda o: aio_loop.call_soon_threadsafe(outputs.put_nowait, o))
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
