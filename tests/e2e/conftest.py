"""A real local mesh for the end-to-end tests: etcd, manager, 3 attention servers, 1 compute, router.

Every attention server holds only ``BLOCKS_PER_SERVER`` rBlocks, so any prompt longer than
``BLOCKS_PER_SERVER * 16`` tokens must spread its KV over several servers.

Every mesh runs mTLS, as ``infinite-llm up`` does: one cluster CA for the session (``INFINITE_LLM_TLS_DIR``,
which the meshes, the SDK and ``cluster_state`` read; the client role), and :func:`mesh_channel` dials a
service directly with the role that may call it.
"""

from __future__ import annotations

import os
import time

import grpc
import httpx
import openai
import pytest

from infinite_llm.core.rmanager import KVLayout
from infinite_llm.mesh import LocalMesh, MeshConfig
from infinite_llm.models.registry import load_tokenizer, resolve_model
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.pb.v1 import compute_instance_pb2 as cpb
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.rpc.certs import write_tls_dir
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.rpc.tls import TLS_DIR_ENV, load_tls_dir

BLOCK_SIZE = 16
BLOCKS_PER_SERVER = 8
# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, fp32
BYTES_PER_BLOCK = KVLayout(30, BLOCK_SIZE, 3, 64).bytes_per_block
# The mesh's gateway inherits INFINITE_LLM_API_KEY from the environment, if one is set there.
API_KEY = os.environ.get("INFINITE_LLM_API_KEY") or "none"


def mesh_config(**overrides) -> MeshConfig:
    """The e2e tests' mesh: 3 small attention servers (BLOCKS_PER_SERVER rBlocks each), 1 compute instance."""
    fields = dict(
        attention_servers=3,
        compute_instances=1,
        kv_memory_bytes=BLOCKS_PER_SERVER * BYTES_PER_BLOCK,
        router_port=0,  # any free port; moved if another process takes it before the router binds
        block_size=BLOCK_SIZE,
        member_ttl_s=3,
        max_num_batched_tokens=256,
        gateway_port=0,
    )
    return MeshConfig(**{**fields, **overrides})


@pytest.fixture(scope="session", autouse=True)
def cluster_tls_dir(tmp_path_factory):
    """The session's cluster CA and certificates, named by ``INFINITE_LLM_TLS_DIR`` while e2e tests run."""
    directory = write_tls_dir(tmp_path_factory.mktemp("cluster-tls"))
    before = os.environ.get(TLS_DIR_ENV)
    os.environ[TLS_DIR_ENV] = str(directory)
    yield directory
    if before is None:
        os.environ.pop(TLS_DIR_ENV, None)
    else:
        os.environ[TLS_DIR_ENV] = before


def mesh_channel(address: str, role: str = "manager") -> grpc.Channel:
    """A blocking channel to one service of a mesh, with ``role``'s certificate (the mesh's own, else the
    session's)."""
    directory = os.environ.get(TLS_DIR_ENV)
    return sync_channel(address, tls=load_tls_dir(directory, role) if directory else None)


@pytest.fixture(scope="session")
def mesh(default_model_path):
    with LocalMesh(mesh_config()) as m:
        yield m


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    """The default model's tokenizer, as the gateway loads it."""
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def http(mesh):
    """An HTTP client of the session mesh's gateway, with its API key (no proxies from the environment)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=f"http://{mesh.gateway_address}", timeout=300, trust_env=False, headers=headers) as c:
        yield c


@pytest.fixture(scope="module")
def oai(mesh):
    """The official OpenAI client on the session mesh's gateway."""
    return openai.OpenAI(base_url=f"http://{mesh.gateway_address}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def server_stats(address: str) -> apb.GetStatsResponse:
    with mesh_channel(address) as ch:
        return agrpc.AttentionServerStub(ch).GetStats(apb.GetStatsRequest(), timeout=5)


def compute_stats(address: str) -> cpb.ComputeStatsResponse:
    """A compute instance's counters (asked as the router, the role its GetStats admits)."""
    with mesh_channel(address, "router") as ch:
        return cgrpc.ComputeInstanceStub(ch).GetStats(cpb.ComputeStatsRequest(), timeout=5)


def all_blocks_free(mesh: LocalMesh) -> bool:
    stats = [server_stats(p.address) for p in mesh.attention_servers() if p.alive()]
    return all(s.num_used == 0 and s.num_reserved == 0 and s.num_free == s.num_blocks for s in stats)


def wait_until(cond, timeout_s: float = 10.0) -> bool:
    """Poll ``cond`` every 0.1 s for up to ``timeout_s`` seconds (asynchronous frees, lease expiry)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


RECOVERIES = "infinite_llm:step_recoveries_total"


def _recoveries(meshes: list[LocalMesh]) -> dict[str, float]:
    """``{compute instance name: step_recoveries_total}`` of the live compute instances of ``meshes``."""
    from tests.e2e.test_observability import scrape, value

    out = {}
    for m in meshes:
        for p in m.compute_instances():
            if p.alive() and p.metrics_address:
                try:
                    out[p.name] = value(scrape(p.metrics_address), RECOVERIES)
                except OSError:
                    pass  # not serving /metrics (yet, or any more): nothing to compare
    return out


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """No test recomputes a step unless it says so (``@pytest.mark.step_recoveries``, for tests that stop or
    kill an attention server): a recovery gives the same greedy tokens, so output checks cannot see one, yet
    it means an attention server refused or failed a step (issue 13's first re-attach design did, hidden).
    A test that fails keeps its meshes' logs (``LocalMesh.keep_logs``): the directory its message names."""
    meshes = [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, LocalMesh)]
    before = _recoveries(meshes) if meshes else {}
    try:
        result = yield  # a failed test raises here: its own error is the one reported
        if meshes and item.get_closest_marker("step_recoveries") is None:
            after = _recoveries(meshes)
            grown = {name: after[name] - n for name, n in before.items() if after.get(name, n) > n}
            assert not grown, f"steps recomputed after an attention server failed or refused them: {grown}"
    except BaseException:
        for m in meshes:
            m.keep_logs = True
        raise
    return result
