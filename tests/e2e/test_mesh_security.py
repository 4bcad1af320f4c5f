"""mTLS and roles on a real mesh (the session's, started as ``infinite-llm up`` starts one): every gRPC port
refuses plaintext and certificates of another CA; the attacks of issue 11 with a valid certificate of the
wrong role or identity are refused (PERMISSION_DENIED, or an abort that does not happen), and the victim's
request finishes with the same tokens as an undisturbed run; health stays open to every role."""

from __future__ import annotations

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infinite_llm.client import Client
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.pb.v1 import router_pb2_grpc as rgrpc
from infinite_llm.rpc.certs import cert_pem, key_pem, make_leaf, write_tls_dir
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.rpc.tls import ROLES, TlsConfig, load_tls_dir
from infinite_llm.services.admin import cluster_state
from tests.e2e.conftest import all_blocks_free, mesh_channel, wait_until

PARAMS = dict(max_tokens=24, temperature=0, ignore_eos=True)
PROMPT = "The attention layers of a long-context model can live on other machines because"


def _ports(mesh) -> dict[str, str]:
    return {
        "manager": mesh.manager_address,
        "attention": mesh.attention_servers()[0].address,
        "compute": mesh.compute_instances()[0].address,
        "router": mesh.router_address,
    }


def _health(address: str, tls: TlsConfig | None) -> grpc.StatusCode | int:
    with sync_channel(address, tls=tls) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError as e:
            return e.code()


def _code(call, request) -> grpc.StatusCode:  # noqa: ANN001
    try:
        reply = call(request, timeout=10)
        if not hasattr(reply, "ByteSize"):
            list(reply)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _forged(cluster_tls_dir, role: str, common_name: str) -> TlsConfig:
    """A valid certificate of ``role`` from the cluster CA, with another identity (subject)."""
    ca_cert = x509.load_pem_x509_certificate((cluster_tls_dir / "ca.pem").read_bytes())
    ca_key = load_pem_private_key((cluster_tls_dir / "ca-key.pem").read_bytes(), None)
    cert, key = make_leaf(role, ca_cert, ca_key, common_name=common_name)
    return TlsConfig(role, ca_cert.public_bytes(_pem()), cert_pem(cert), key_pem(key))


def _pem():  # noqa: ANN202
    from cryptography.hazmat.primitives.serialization import Encoding

    return Encoding.PEM


def _servers(mesh) -> dict[str, str]:
    return {s.server_id: s.address for s in cluster_state(mesh.manager_address).servers}


def test_every_port_refuses_plaintext_and_another_ca(mesh, tmp_path):
    other_ca = load_tls_dir(write_tls_dir(tmp_path / "other"), "manager")
    for name, address in _ports(mesh).items():
        assert _health(address, None) == grpc.StatusCode.UNAVAILABLE, name
        assert _health(address, other_ca) == grpc.StatusCode.UNAVAILABLE, name


@pytest.mark.parametrize("role", ROLES)
def test_health_stays_open_to_every_role(mesh, role, cluster_tls_dir):
    for name, address in _ports(mesh).items():
        assert _health(address, load_tls_dir(cluster_tls_dir, role)) == health_pb2.HealthCheckResponse.SERVING, name


def test_a_client_certificate_cannot_touch_kv_placement_or_compute(mesh):
    """Issue 11's reads and frees of another user's KV, with the client role: all PERMISSION_DENIED."""
    denied = grpc.StatusCode.PERMISSION_DENIED
    with mesh_channel(mesh.attention_servers()[0].address, "client") as ch:
        stub = agrpc.AttentionServerStub(ch)
        assert _code(stub.FreeSequence, apb.FreeSequenceRequest(seq_id="victim")) == denied
        assert _code(stub.ExportBlocks, apb.ExportBlocksRequest(seq_id="victim")) == denied
        assert _code(stub.GetStats, apb.GetStatsRequest()) == denied
    with mesh_channel(mesh.manager_address, "client") as ch:
        stub = mgrpc.GlobalManagerStub(ch)
        assert _code(stub.Release, mpb.ReleaseRequest(seq_id="victim")) == denied
        assert _code(stub.Place, mpb.PlaceRequest(seq_id="s", num_blocks=1)) == denied
    with mesh_channel(mesh.compute_instances()[0].address, "client") as ch:
        stub = cgrpc.ComputeInstanceStub(ch)
        assert _code(stub.Abort, gpb.AbortRequest(request_id="victim")) == denied
        request = gpb.GenerateRequest(text="hi", sampling=gpb.SamplingParams(max_tokens=1))
        assert _code(stub.Generate, request) == denied
    with mesh_channel(mesh.router_address, "attention") as ch:  # and a service certificate at the public door
        assert _code(rgrpc.RouterStub(ch).Abort, gpb.AbortRequest(request_id="victim")) == denied


@pytest.mark.parametrize("role", ["client", "compute", "router", "gateway", "manager"])
def test_a_rogue_registration_from_a_non_attention_identity_is_refused(mesh, role):
    before = _servers(mesh)
    with mesh_channel(mesh.manager_address, role) as ch:
        request = mpb.RegisterRequest(server_id="rogue", address="127.0.0.1:9", capacity_blocks=10**6, block_size=16)
        assert _code(mgrpc.GlobalManagerStub(ch).Register, request) == grpc.StatusCode.PERMISSION_DENIED
    assert _servers(mesh) == before and "rogue" not in before


def test_a_live_server_id_cannot_be_registered_from_another_identity_or_address(mesh, cluster_tls_dir):
    before = _servers(mesh)
    victim = sorted(before)[0]
    intruder = _forged(cluster_tls_dir, "attention", "intruder")  # a valid attention certificate, another subject
    same_address = mpb.RegisterRequest(server_id=victim, address=before[victim], capacity_blocks=10**6, block_size=16)
    other_address = mpb.RegisterRequest(server_id=victim, address="127.0.0.1:9", capacity_blocks=10**6, block_size=16)
    with sync_channel(mesh.manager_address, tls=intruder) as ch:
        register = mgrpc.GlobalManagerStub(ch).Register
        assert _code(register, same_address) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(register, other_address) == grpc.StatusCode.PERMISSION_DENIED
    with mesh_channel(mesh.manager_address, "attention") as ch:  # the servers' own identity, another address
        assert _code(mgrpc.GlobalManagerStub(ch).Register, other_address) == grpc.StatusCode.PERMISSION_DENIED
    with sync_channel(mesh.manager_address, tls=intruder) as ch:  # nor can it speak for the victim
        beat = mpb.HeartbeatRequest(server_id=victim, free_blocks=0)
        assert _code(mgrpc.GlobalManagerStub(ch).Heartbeat, beat) == grpc.StatusCode.PERMISSION_DENIED
    after = cluster_state(mesh.manager_address).servers
    assert {s.server_id: s.address for s in after} == before
    assert all(s.capacity_blocks < 10**6 for s in after)


def test_another_clients_request_cannot_be_aborted_through_the_router(mesh, cluster_tls_dir):
    """Tenant B knows tenant A's request id: its Abort does nothing (as for an unknown id), and A's stream
    ends with every token, the same as an undisturbed run. A's own Abort still works."""
    with Client(mesh.router_address) as a:
        undisturbed = a.generate(PROMPT, **PARAMS).token_ids
        tenant_b = _forged(cluster_tls_dir, "client", "tenant-b")
        with Client(mesh.router_address, tls=tenant_b) as b:
            stream = a.stream(PROMPT, request_id="victim-req", **PARAMS)
            first = next(stream)
            assert b.abort("victim-req") is False
            chunks = [first, *stream]
        assert [t for c in chunks for t in c.token_ids] == undisturbed
        assert chunks[-1].finish_reason == "length"
        stream = a.stream(PROMPT, request_id="own-req", **PARAMS)
        next(stream)
        assert a.abort("own-req") is True
        assert list(stream)[-1].finish_reason == "abort"
    assert wait_until(lambda: all_blocks_free(mesh) and not cluster_state(mesh.manager_address).ledger)


def _computes(mesh) -> dict[str, str]:
    with mesh_channel(mesh.manager_address, "client") as ch:
        reply = mgrpc.GlobalManagerStub(ch).ListComputeInstances(mpb.ListComputeInstancesRequest(), timeout=10)
    return {c.instance_id: c.address for c in reply.instances}


@pytest.mark.parametrize("role", ["attention", "client", "router", "gateway", "manager"])
def test_compute_membership_calls_from_a_non_compute_identity_are_refused(mesh, role):
    before = _computes(mesh)
    victim = sorted(before)[0]
    denied = grpc.StatusCode.PERMISSION_DENIED
    with mesh_channel(mesh.manager_address, role) as ch:
        stub = mgrpc.GlobalManagerStub(ch)
        rogue = mpb.RegisterComputeRequest(instance_id="rogue-compute", address="127.0.0.1:9")
        assert _code(stub.RegisterCompute, rogue) == denied
        assert _code(stub.HeartbeatCompute, mpb.HeartbeatComputeRequest(instance_id=victim)) == denied
        assert _code(stub.DeregisterCompute, mpb.DeregisterComputeRequest(instance_id=victim)) == denied
    assert _computes(mesh) == before


def test_a_live_compute_id_cannot_be_registered_or_spoken_for_by_another_identity(mesh, cluster_tls_dir):
    """A valid compute certificate with another subject can neither take over a live instance's id (at its
    address or another), nor heartbeat, report sequences or deregister for it; the mesh keeps serving."""
    before = _computes(mesh)
    victim = sorted(before)[0]
    intruder = _forged(cluster_tls_dir, "compute", "intruder")
    denied = grpc.StatusCode.PERMISSION_DENIED
    with sync_channel(mesh.manager_address, tls=intruder) as ch:
        stub = mgrpc.GlobalManagerStub(ch)
        for address in (before[victim], "127.0.0.1:9"):
            request = mpb.RegisterComputeRequest(instance_id=victim, address=address)
            assert _code(stub.RegisterCompute, request) == denied
        beat = mpb.HeartbeatComputeRequest(instance_id=victim, reports_seq_ids=True)  # "it holds nothing"
        assert _code(stub.HeartbeatCompute, beat) == denied
        assert _code(stub.DeregisterCompute, mpb.DeregisterComputeRequest(instance_id=victim)) == denied
    assert _computes(mesh) == before
    with Client(mesh.router_address) as c:
        assert c.generate(PROMPT, max_tokens=4, temperature=0).finish_reason == "length"


def test_the_meshs_etcd_admits_only_the_managers_etcd_certificate(mesh, tmp_path):
    """Issue 11's "etcd itself is open": the mesh's etcd serves TLS and trusts only etcd's own CA: the
    manager's etcd certificate lists the members; plaintext, another CA's certificate, and the cluster
    certificates of every other role (even presented trusting etcd's CA) are refused."""
    import asyncio
    import dataclasses

    from infinite_llm.core.errors import Unavailable
    from infinite_llm.state.etcd_store import EtcdStore

    assert mesh.etcd.endpoint.startswith("https://") and mesh.etcd.is_healthy()
    manager = load_tls_dir(mesh.etcd_tls_dir, "manager", server_name=None)
    other_ca = load_tls_dir(write_tls_dir(tmp_path / "other"), "manager")

    async def list_members(tls: TlsConfig | None) -> int:
        store = EtcdStore(mesh.etcd.host, mesh.etcd.client_port, timeout_s=3.0, tls=tls)
        await store.connect()
        try:
            return len((await store.get_prefix("members/")).items)
        finally:
            await store.close()

    # Earlier tests of the session mesh kill and restart servers: the count is whatever is registered now.
    assert asyncio.run(list_members(manager)) >= 1
    cluster = [dataclasses.replace(mesh.tls(role), ca_pem=manager.ca_pem, server_name=None) for role in ROLES]
    for refused in (None, other_ca, *cluster):
        with pytest.raises(Unavailable):
            asyncio.run(list_members(refused))


def test_another_compute_identity_can_neither_grow_nor_release_a_live_instances_sequence(mesh, cluster_tls_dir):
    """A valid compute certificate with another subject learns a running sequence's id (from the ledger):
    its Release and Place of that sequence are PERMISSION_DENIED (as the owning instance, or naming no
    instance), and the victim's stream ends with every token of an undisturbed run."""
    intruder = _forged(cluster_tls_dir, "compute", "intruder")
    denied = grpc.StatusCode.PERMISSION_DENIED
    with Client(mesh.router_address) as client:
        undisturbed = client.generate(PROMPT, **PARAMS).token_ids
        stream = client.stream(PROMPT, **PARAMS)
        chunks = [next(stream)]
        (entry,) = cluster_state(mesh.manager_address).ledger  # the victim's sequence, placed and owned
        assert entry.instance_id in _computes(mesh)
        with sync_channel(mesh.manager_address, tls=intruder) as ch:
            stub = mgrpc.GlobalManagerStub(ch)
            assert _code(stub.Release, mpb.ReleaseRequest(seq_id=entry.seq_id)) == denied
            for instance_id in (entry.instance_id, ""):
                grow = mpb.PlaceRequest(seq_id=entry.seq_id, num_blocks=1, instance_id=instance_id)
                assert _code(stub.Place, grow) == denied
        chunks.extend(stream)
    assert [t for c in chunks for t in c.token_ids] == undisturbed
    assert chunks[-1].finish_reason == "length"
    assert wait_until(lambda: all_blocks_free(mesh) and not cluster_state(mesh.manager_address).ledger)
