"""The gateway's model lookup goes through the SDK, so a router restarting is retried as generation is (before,
a lookup after the 30 s card cache expired used a channel of its own and failed at the first UNAVAILABLE).
A real gRPC Router on loopback that refuses the first ``ListModels`` calls."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from infinite_llm.core.errors import Unavailable
from infinite_llm.pb.v1 import router_pb2 as rpb
from infinite_llm.pb.v1 import router_pb2_grpc as rgrpc
from infinite_llm.rpc.server import Service, start_server
from infinite_llm.services.gateway.backend import RouterBackend


class RestartingRouter(rgrpc.RouterServicer):
    """Answers ``ListModels`` UNAVAILABLE ``refuse`` times, then with one model card; counts the attempts."""

    def __init__(self, refuse: int) -> None:
        self.refuse, self.attempts = refuse, 0

    async def ListModels(self, request, context):  # noqa: N802, ANN001, ANN201
        self.attempts += 1
        if self.attempts <= self.refuse:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is restarting")
        return rpb.ListModelsResponse(models=[rpb.ModelCard(id="m", max_model_len=2048, owned_by="me")])


@pytest.mark.parametrize(("refuse", "answered"), [(2, True), (5, False)])
def test_a_model_lookup_is_retried_like_generation(refuse, answered):
    async def scenario():
        router = RestartingRouter(refuse)
        server = await start_server([Service.of(rpb, "Router", rgrpc.add_RouterServicer_to_server, router)])
        backend = RouterBackend(f"127.0.0.1:{server.port}", tokenizer=None, tls=None)
        try:
            if answered:  # the SDK's default: 2 retries
                (card,) = await backend.models(fresh=True)
                assert (card.id, card.max_model_len, card.owned_by) == ("m", 2048, "me")
            else:
                with pytest.raises(Unavailable, match="the mesh is unavailable: router 127.0.0.1:"):
                    await backend.models(fresh=True)
            assert router.attempts == min(refuse + 1, 3)
        finally:
            await backend.close()
            await server.stop(0)

    asyncio.run(scenario())
