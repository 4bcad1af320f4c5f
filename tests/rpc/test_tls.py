"""mTLS and roles on real gRPC servers on loopback: the handshake refuses plaintext, certificates of another
CA and callers without a certificate; each service admits only the roles of ``rpc/access.py``
(PERMISSION_DENIED otherwise); health stays open to every role; the router's API keys.

The services are stand-ins whose every RPC answers an empty reply: a call that gets OK went through the
TLS handshake and the role check, one that gets PERMISSION_DENIED did not.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.pb.v1 import attention_server_pb2 as apb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as agrpc
from infinite_llm.pb.v1 import compute_instance_pb2 as cpb
from infinite_llm.pb.v1 import compute_instance_pb2_grpc as cgrpc
from infinite_llm.pb.v1 import generate_pb2 as gpb
from infinite_llm.pb.v1 import manager_pb2 as mpb
from infinite_llm.pb.v1 import manager_pb2_grpc as mgrpc
from infinite_llm.pb.v1 import router_pb2 as rpb
from infinite_llm.pb.v1 import router_pb2_grpc as rgrpc
from infinite_llm.rpc.certs import make_ca, make_leaf, write_tls_dir
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.rpc.interceptors.api_key import ApiKeyInterceptor
from infinite_llm.rpc.server import Service, default_interceptors, start_server
from infinite_llm.rpc.tls import ROLES, TLS_DIR_ENV, TlsConfig, client_tls, load_tls_dir


def stand_in(pb2, service: str, base: type) -> object:
    """A servicer of ``service`` whose every RPC answers an empty reply (streams: no message)."""
    from google.protobuf import message_factory

    methods = {}
    for m in pb2.DESCRIPTOR.services_by_name[service].methods:
        reply = message_factory.GetMessageClass(m.output_type)
        if m.server_streaming:

            async def stream(self, request, context):
                return
                yield

            methods[m.name] = stream
        else:
            methods[m.name] = _unary(reply)
    return type(f"StandIn{service}", (base,), methods)()


def _unary(reply: type):
    async def unary(self, request, context):
        return reply()

    return unary


def served(pb2, service: str, add, base) -> Service:
    return Service.of(pb2, service, add, stand_in(pb2, service, base))


# (service, a call of it: (stub class, method, request), roles admitted)
SERVICES = {
    "attention": (
        served(apb, "AttentionServer", agrpc.add_AttentionServerServicer_to_server, agrpc.AttentionServerServicer),
        [
            (agrpc.AttentionServerStub, "FreeSequence", apb.FreeSequenceRequest(seq_id="victim")),
            (agrpc.AttentionServerStub, "ExportBlocks", apb.ExportBlocksRequest(seq_id="victim")),
            (agrpc.AttentionServerStub, "GetStats", apb.GetStatsRequest()),
        ],
        {"manager", "compute"},
    ),
    "manager": (
        served(mpb, "GlobalManager", mgrpc.add_GlobalManagerServicer_to_server, mgrpc.GlobalManagerServicer),
        [
            (mgrpc.GlobalManagerStub, "Place", mpb.PlaceRequest(seq_id="s", num_blocks=1)),
            (mgrpc.GlobalManagerStub, "Release", mpb.ReleaseRequest(seq_id="victim")),
            (mgrpc.GlobalManagerStub, "MatchPrefix", mpb.MatchPrefixRequest(seq_id="s")),
            (mgrpc.GlobalManagerStub, "PublishPrefix", mpb.PublishPrefixRequest()),
        ],
        {"compute"},
    ),
    "compute": (
        served(cpb, "ComputeInstance", cgrpc.add_ComputeInstanceServicer_to_server, cgrpc.ComputeInstanceServicer),
        [(cgrpc.ComputeInstanceStub, "Abort", gpb.AbortRequest(request_id="victim"))],
        {"router", "manager"},
    ),
    "router": (
        served(rpb, "Router", rgrpc.add_RouterServicer_to_server, rgrpc.RouterServicer),
        [
            (rgrpc.RouterStub, "Abort", gpb.AbortRequest(request_id="victim")),
            (rgrpc.RouterStub, "ListModels", rpb.ListModelsRequest()),
        ],
        {"client", "gateway"},
    ),
}
MANAGER_METHOD_ROLES = {  # the manager's RPCs with their own roles
    "Register": (mpb.RegisterRequest(server_id="rogue", address="127.0.0.1:1"), {"attention"}),
    "Heartbeat": (mpb.HeartbeatRequest(server_id="attn-0"), {"attention"}),
    "Deregister": (mpb.DeregisterRequest(server_id="attn-0"), {"attention"}),
    "GetClusterState": (mpb.ClusterStateRequest(), {"attention", "compute", "router", "gateway", "client", "manager"}),
    "ListComputeInstances": (mpb.ListComputeInstancesRequest(), {"compute", "router", "client", "manager"}),
}


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory):
    return write_tls_dir(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def servers(loop, tls_dir):
    """One TLS server per service, each with its own role's certificate: {name: port}."""
    started = {
        name: loop.run(start_server([service], tls=load_tls_dir(tls_dir, name)))
        for name, (service, _, _) in SERVICES.items()
    }
    yield {name: s.port for name, s in started.items()}
    for s in started.values():
        loop.run(s.stop(0))


def call(port: int, stub_class, method: str, request, tls: TlsConfig | None, metadata=()) -> grpc.StatusCode:
    """The status code of one call (OK when it succeeded; streamed replies are read to the end)."""
    with sync_channel(f"127.0.0.1:{port}", tls=tls) as channel:
        try:
            reply = getattr(stub_class(channel), method)(request, timeout=5, metadata=metadata)
            if not hasattr(reply, "ByteSize"):  # a stream
                list(reply)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def health(port: int, tls: TlsConfig | None) -> grpc.StatusCode | int:
    with sync_channel(f"127.0.0.1:{port}", tls=tls) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError as e:
            return e.code()


@pytest.mark.parametrize("service", sorted(SERVICES))
@pytest.mark.parametrize("role", ROLES)
def test_each_service_admits_only_its_roles(servers, tls_dir, service, role):
    _, calls, admitted = SERVICES[service]
    expected = grpc.StatusCode.OK if role in admitted else grpc.StatusCode.PERMISSION_DENIED
    for stub_class, method, request in calls:
        assert call(servers[service], stub_class, method, request, load_tls_dir(tls_dir, role)) == expected, method


@pytest.mark.parametrize("method", sorted(MANAGER_METHOD_ROLES))
@pytest.mark.parametrize("role", ROLES)
def test_manager_rpcs_with_roles_of_their_own(servers, tls_dir, method, role):
    request, admitted = MANAGER_METHOD_ROLES[method]
    got = call(servers["manager"], mgrpc.GlobalManagerStub, method, request, load_tls_dir(tls_dir, role))
    assert got == (grpc.StatusCode.OK if role in admitted else grpc.StatusCode.PERMISSION_DENIED)


ATTENTION_METHOD_ROLES = {  # prefix caching: only the manager attaches or caches rBlocks (in step with its index)
    "AttachBlocks": apb.AttachBlocksRequest(seq_id="victim"),
    "CacheBlocks": apb.CacheBlocksRequest(seq_id="victim"),
}


@pytest.mark.parametrize("method", sorted(ATTENTION_METHOD_ROLES))
@pytest.mark.parametrize("role", ROLES)
def test_only_the_manager_attaches_or_caches_rblocks(servers, tls_dir, method, role):
    request = ATTENTION_METHOD_ROLES[method]
    got = call(servers["attention"], agrpc.AttentionServerStub, method, request, load_tls_dir(tls_dir, role))
    assert got == (grpc.StatusCode.OK if role == "manager" else grpc.StatusCode.PERMISSION_DENIED)


@pytest.mark.parametrize("role", ROLES)
def test_health_stays_open_to_every_role(servers, tls_dir, role):
    for port in servers.values():
        assert health(port, load_tls_dir(tls_dir, role)) == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_to_a_tls_port_fails_the_handshake(servers):
    for name, (_, calls, _) in SERVICES.items():
        stub_class, method, request = calls[0]
        assert call(servers[name], stub_class, method, request, tls=None) == grpc.StatusCode.UNAVAILABLE, name
        assert health(servers[name], tls=None) == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_from_another_ca_fails_the_handshake(servers, tmp_path):
    rogue = load_tls_dir(write_tls_dir(tmp_path / "rogue"), "manager")  # right role, wrong CA
    for name, (_, calls, _) in SERVICES.items():
        stub_class, method, request = calls[0]
        assert call(servers[name], stub_class, method, request, rogue) == grpc.StatusCode.UNAVAILABLE, name
        assert health(servers[name], rogue) == grpc.StatusCode.UNAVAILABLE


def test_a_rogue_certificate_trusting_the_real_ca_is_refused(servers, tls_dir):
    """A caller that trusts the cluster CA (it can verify the servers) but whose own certificate another CA
    signed, claiming the manager role: the server refuses the handshake."""
    from infinite_llm.rpc.certs import cert_pem, key_pem

    ca_cert, ca_key = make_ca()
    cert, key = make_leaf("manager", ca_cert, ca_key)
    real = load_tls_dir(tls_dir, "manager")
    forged = TlsConfig("manager", real.ca_pem, cert_pem(cert), key_pem(key))
    stub_class, method, request = SERVICES["attention"][1][0]
    assert call(servers["attention"], stub_class, method, request, forged) == grpc.StatusCode.UNAVAILABLE
    assert call(servers["attention"], stub_class, method, request, real) == grpc.StatusCode.OK


def test_a_client_without_a_certificate_is_refused(servers, tls_dir):
    ca = (tls_dir / "ca.pem").read_bytes()
    creds = grpc.ssl_channel_credentials(ca)  # verifies the server, presents nothing
    options = [("grpc.ssl_target_name_override", "infinite-llm.mesh")]
    with grpc.secure_channel(f"127.0.0.1:{servers['attention']}", creds, options=options) as channel:
        with pytest.raises(grpc.RpcError) as e:
            agrpc.AttentionServerStub(channel).GetStats(apb.GetStatsRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_certificate_cannot_serve_the_mesh(loop, tls_dir):
    """The client role's certificate has no server name: a server using it fails every mesh channel's check."""
    service = SERVICES["attention"][0]
    server = loop.run(start_server([service], tls=load_tls_dir(tls_dir, "client")))
    try:
        assert health(server.port, load_tls_dir(tls_dir, "manager")) == grpc.StatusCode.UNAVAILABLE
    finally:
        loop.run(server.stop(0))


def test_server_name_checks_also_pass_for_loopback_without_the_override(servers, tls_dir):
    """Tools that dial ``localhost`` or ``127.0.0.1`` with no name override verify the certificate too."""
    client = load_tls_dir(tls_dir, "client")
    no_override = TlsConfig("client", client.ca_pem, client.cert_pem, client.key_pem, server_name=None)
    for host in ("localhost", "127.0.0.1"):
        with grpc.secure_channel(f"{host}:{servers['router']}", no_override.channel_credentials()) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


# ---- the router's API keys ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_router(loop, tls_dir):
    service = SERVICES["router"][0]
    interceptors = [*default_interceptors(), ApiKeyInterceptor(["k-one", "k-two"])]
    server = loop.run(start_server([service], interceptors=interceptors, tls=load_tls_dir(tls_dir, "router")))
    yield server.port
    loop.run(server.stop(0))


@pytest.mark.parametrize(
    "metadata,expected",
    [
        ((), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", "Basic k-one"),), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", "Bearer k-one"),), grpc.StatusCode.OK),
        ((("authorization", "bearer k-two"),), grpc.StatusCode.OK),
    ],
)
def test_router_requires_an_api_key_from_clients(keyed_router, tls_dir, metadata, expected):
    got = call(
        keyed_router, rgrpc.RouterStub, "ListModels", rpb.ListModelsRequest(), load_tls_dir(tls_dir, "client"), metadata
    )
    assert got == expected


def test_router_api_keys_exempt_the_gateway_and_keep_health_open(keyed_router, tls_dir):
    gateway = load_tls_dir(tls_dir, "gateway")
    assert call(keyed_router, rgrpc.RouterStub, "ListModels", rpb.ListModelsRequest(), gateway) == grpc.StatusCode.OK
    assert health(keyed_router, load_tls_dir(tls_dir, "client")) == health_pb2.HealthCheckResponse.SERVING
    # a compute certificate with the right key is still the wrong role
    compute = load_tls_dir(tls_dir, "compute")
    got = call(
        keyed_router,
        rgrpc.RouterStub,
        "ListModels",
        rpb.ListModelsRequest(),
        compute,
        (("authorization", "Bearer k-one"),),
    )
    assert got == grpc.StatusCode.PERMISSION_DENIED


# ---- TLS directories ----------------------------------------------------------------------------------------
def test_a_tls_dir_without_the_role_files_is_invalid(tmp_path):
    write_tls_dir(tmp_path, roles=("client",))
    with pytest.raises(InvalidRequest, match="cannot read attention.pem"):
        load_tls_dir(tmp_path, "attention")
    (tmp_path / "attention.pem").write_text("not a certificate")
    (tmp_path / "attention-key.pem").write_text("nor a key")
    with pytest.raises(InvalidRequest, match="attention.pem is not PEM"):
        load_tls_dir(tmp_path, "attention")
    with pytest.raises(InvalidRequest, match="unknown role 'operator'"):
        load_tls_dir(tmp_path, "operator")


def test_the_sdk_names_its_tls_keyword_and_the_cli_its_flag(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    with pytest.raises(InvalidRequest) as e:
        client_tls(str(missing))
    assert (e.value.message, e.value.param) == (
        f"tls={str(missing)!r}: cannot read ca.pem: No such file or directory",
        "tls",
    )
    assert e.value.__cause__ is None and e.value.__suppress_context__
    monkeypatch.setenv(TLS_DIR_ENV, str(missing))
    with pytest.raises(InvalidRequest, match=f"^{TLS_DIR_ENV}='.*nowhere': cannot read ca.pem"):
        client_tls()
    with pytest.raises(InvalidRequest, match=f"^--tls-dir {missing}: cannot read ca.pem"):
        load_tls_dir(missing, "client")


def test_keys_are_private_and_the_role_is_in_cn_and_uri_san(tmp_path):
    from cryptography import x509

    write_tls_dir(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"ca.pem", "ca-key.pem"} | {
        f"{r}{suffix}" for r in ROLES for suffix in (".pem", "-key.pem")
    }
    for role in ROLES:
        assert (tmp_path / f"{role}-key.pem").stat().st_mode & 0o077 == 0
        cert = x509.load_pem_x509_certificate((tmp_path / f"{role}.pem").read_bytes())
        assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == role
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [f"spiffe://infinite-llm/role/{role}"]
        dns = san.get_values_for_type(x509.DNSName)
        assert dns == ([] if role == "client" else ["infinite-llm.mesh", "localhost"])


def served_serial(port: int, tls_dir) -> int:
    """The serial number of the certificate a server presents in a new handshake (as the manager)."""
    import socket
    import ssl

    from cryptography import x509

    context = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
    context.load_cert_chain(tls_dir / "manager.pem", tls_dir / "manager-key.pem")
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with context.wrap_socket(sock, server_hostname="infinite-llm.mesh") as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def test_a_renewed_certificate_is_served_without_a_restart(loop, tmp_path):
    """New handshakes get the files as they are now (Kubernetes rewrites a mounted Secret in place)."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    from infinite_llm.rpc.certs import cert_pem, key_pem

    directory = write_tls_dir(tmp_path / "tls")
    server = loop.run(start_server([SERVICES["attention"][0]], tls=load_tls_dir(directory, "attention")))
    try:
        first = x509.load_pem_x509_certificate((directory / "attention.pem").read_bytes())
        assert served_serial(server.port, directory) == first.serial_number
        ca_cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
        ca_key = load_pem_private_key((directory / "ca-key.pem").read_bytes(), None)
        renewed, key = make_leaf("attention", ca_cert, ca_key)
        (directory / "attention-key.pem").write_bytes(key_pem(key))
        (directory / "attention.pem").write_bytes(cert_pem(renewed))
        assert served_serial(server.port, directory) == renewed.serial_number != first.serial_number
        assert health(server.port, load_tls_dir(directory, "manager")) == health_pb2.HealthCheckResponse.SERVING
    finally:
        loop.run(server.stop(0))


def test_a_plaintext_health_port_answers_only_health_for_kubelet_probes(loop, tls_dir):
    """kubelet's gRPC probes present no certificate: ``--health-port`` serves the TLS server's health
    statuses in plaintext, and no other service; the TLS port still refuses plaintext."""
    from infinite_llm.rpc.tls import set_process_tls
    from infinite_llm.state.etcd_launcher import free_port

    health_port = free_port()
    set_process_tls(load_tls_dir(tls_dir, "attention"), health_port=health_port)
    try:
        server = loop.run(start_server([SERVICES["attention"][0]]))  # the process's identity
    finally:
        set_process_tls(None)
    try:
        plain = f"127.0.0.1:{health_port}"
        with sync_channel(plain, tls=None) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            got = call(health_port, agrpc.AttentionServerStub, "GetStats", apb.GetStatsRequest(), tls=None)
            assert got == grpc.StatusCode.UNIMPLEMENTED
        assert health(server.port, None) == grpc.StatusCode.UNAVAILABLE
        loop.run(server.health.enter_graceful_shutdown())  # draining: the probe sees it
        assert health(health_port, None) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        loop.run(server.stop(0))
    assert health(health_port, None) == grpc.StatusCode.UNAVAILABLE
