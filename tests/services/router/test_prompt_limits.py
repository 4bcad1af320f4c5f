"""One big request stalls nobody (issue 11): the router caps prompt and text sizes before any tokenization and
tokenizes off its event loop, with the real SmolLM2 tokenizer."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.pb.v1 import router_pb2 as rpb
from infinite_llm.pb.v1 import router_pb2_grpc as rgrpc
from infinite_llm.rpc.channels import aio_channel
from infinite_llm.rpc.errors import ERROR_PARAM_KEY
from infinite_llm.rpc.server import Service, start_server
from infinite_llm.services.prompt_limits import max_text_chars
from infinite_llm.services.router.servicer import RouterServicer

TEXT = open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8").read()


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from infinite_llm.models.registry import load_model_config, load_tokenizer, resolve_model

    resolved = resolve_model(None)
    return load_tokenizer(resolved, load_model_config(resolved))


async def _router(tokenizer, compute: tuple[str, ...] = ("127.0.0.1:1",)):
    """A router of an 8192-token model whose only compute instance is unreachable (port 1)."""
    router = RouterServicer(list(compute), "smollm2", 8192, tokenizer)
    server = await start_server([Service.of(rpb, "Router", rgrpc.add_RouterServicer_to_server, router)], "127.0.0.1:0")
    return server, rgrpc.RouterStub(aio_channel(f"127.0.0.1:{server.port}"))


def _param(e: grpc.aio.AioRpcError) -> str:
    return dict(e.trailing_metadata() or ()).get(ERROR_PARAM_KEY, "")


def test_oversized_texts_are_refused_at_once_before_tokenization(tokenizer):
    async def scenario():
        server, stub = await _router(tokenizer)
        try:
            assert max_text_chars(8192) == 1 << 20
            huge = "word " * (4 << 20)  # 20 MiB
            one = gpb.SamplingParams(max_tokens=1)
            for param, call in (
                ("text", stub.Tokenize(rpb.TokenizeRequest(text=huge), timeout=30)),
                ("prompt", stub.Generate(gpb.GenerateRequest(text=huge[: 5 << 20], sampling=one), timeout=30)),
                ("prompt", stub.Generate(gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1] * 8193), sampling=one))),
            ):
                start = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
                assert _param(info.value) == param
                assert time.monotonic() - start < 2.0  # not after seconds of tokenizing
            # At the cap a text is tokenized (and exactly as the tokenizer does it).
            text = TEXT[:20000]
            reply = await stub.Tokenize(rpb.TokenizeRequest(text=text), timeout=30)
            assert list(reply.token_ids) == tokenizer.encode(text)
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_a_long_tokenize_does_not_stall_other_calls(tokenizer):
    async def scenario():
        server, stub = await _router(tokenizer)
        try:
            big = (TEXT * 100)[: max_text_chars(8192)]  # 1 MiB: about a second of tokenizing here
            began = time.monotonic()
            tokenize = asyncio.ensure_future(stub.Tokenize(rpb.TokenizeRequest(text=big), timeout=60))
            await asyncio.sleep(0.05)
            gaps = []
            while not tokenize.done():
                start = time.monotonic()
                await stub.ListModels(rpb.ListModelsRequest(), timeout=10)
                gaps.append(time.monotonic() - start)
            took = time.monotonic() - began
            assert len((await tokenize).token_ids) == len(tokenizer.encode(big))
            # Answered all along, not once after the tokenize (on the event loop: one call, as long as it).
            assert len(gaps) >= 3 and max(gaps) < took / 3, (gaps, took)
        finally:
            await server.stop(0)

    asyncio.run(scenario())
