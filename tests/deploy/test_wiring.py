"""How the rendered objects fit together: Services and policies select pods that exist, identities match the
attention servers' registrations, the manager's Role is exactly what its autoscaler calls, and the shared
settings are values the code accepts."""

from __future__ import annotations

import pytest
from kubernetes.utils import parse_quantity

from infinite_llm.rpc.sizes import parse_size
from infinite_llm.services.attention.server import KV_DTYPES, AttentionServerConfig
from infinite_llm.services.manager.autoscale import ScalingConfig
from infinite_llm.services.manager.autoscale.controller import ordinal_of
from infinite_llm.services.manager.autoscale.k8s_client import KubernetesScaler

from .conftest import RENDERS
from .manifests import arg_value, by_kind, config_data, expand, main_container, one, selected

NS = "infinite-llm"


def names(workloads: list[dict]) -> list[str]:
    return sorted(w["metadata"]["name"] for w in workloads)


@pytest.mark.parametrize("render", RENDERS)
def test_every_service_selects_pods_of_the_render_on_a_named_port(rendered, render):
    docs = rendered[render]
    for svc in by_kind(docs, "Service"):
        targets = selected(docs, {"matchLabels": svc["spec"]["selector"]}, svc["metadata"]["namespace"])
        assert targets, f"Service {svc['metadata']['name']} selects no pod"
        for w in targets:
            ports = {p["name"]: p["containerPort"] for p in main_container(w)["ports"]}
            for p in svc["spec"]["ports"]:
                assert ports.get(p["targetPort"]) == p["port"], (svc["metadata"]["name"], p)


@pytest.mark.parametrize("render", RENDERS)
def test_services_select_exactly_their_component(rendered, render):
    docs = rendered[render]
    got = {
        s["metadata"]["name"]: names(selected(docs, {"matchLabels": s["spec"]["selector"]}, NS))
        for s in by_kind(docs, "Service")
    }
    assert got == {
        "etcd": ["etcd"],
        "etcd-client": ["etcd"],
        "manager": ["manager"],
        "attention": ["attention"],
        "compute": ["compute"],
        "router": ["router"],
        "gateway": ["gateway"],
    }


@pytest.mark.parametrize("render", RENDERS)
def test_statefulsets_have_headless_services_that_publish_starting_pods(rendered, render):
    docs = rendered[render]
    for sts in by_kind(docs, "StatefulSet"):
        svc = one(docs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert names(selected(docs, {"matchLabels": svc["spec"]["selector"]}, NS)) == [sts["metadata"]["name"]]


@pytest.mark.parametrize("render", RENDERS)
def test_attention_servers_register_as_their_pod_at_its_stable_name(rendered, render):
    docs = rendered[render]
    sts = one(docs, "StatefulSet", "attention")
    c = main_container(sts)
    pod = {"POD_NAME": "attention-2", "POD_NAMESPACE": NS}  # what the downward API gives pod 2
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]} == {
        "POD_NAME": "metadata.name",
        "POD_NAMESPACE": "metadata.namespace",
        "NODE_NAME": "spec.nodeName",
    }
    server_id = expand(arg_value(c, "--server-id"), pod)
    assert server_id == "attention-2"
    assert expand(arg_value(c, "--advertise-host"), pod) == f"attention-2.{sts['spec']['serviceName']}.{NS}.svc"
    # The autoscaler drains and removes servers by ordinal: the ids must parse for its StatefulSet.
    manager = main_container(one(docs, "Deployment", "manager"))
    statefulset = arg_value(manager, "--k8s-statefulset")
    assert statefulset == sts["metadata"]["name"] and ordinal_of(server_id, statefulset) == 2
    assert arg_value(manager, "--k8s-namespace") == "$(POD_NAMESPACE)"
    # No replicas in the manifest: `kubectl apply` must not undo the autoscaler.
    assert "replicas" not in sts["spec"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"


@pytest.mark.parametrize("render", RENDERS)
def test_compute_instances_register_their_pod_ip_and_node_and_the_router_follows_the_manager(rendered, render):
    """Homes by node: a compute pod and the attention pods on its node report the same spec.nodeName, so the
    manager makes them its homes; the router reaches the pods the manager lists, at their pod IPs."""
    docs = rendered[render]
    compute = main_container(one(docs, "Deployment", "compute"))
    attention = main_container(one(docs, "StatefulSet", "attention"))
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in compute["env"]}
    assert fields == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP", "NODE_NAME": "spec.nodeName"}
    pod = {"POD_NAME": "compute-7f9c-x2", "POD_IP": "10.1.2.3", "NODE_NAME": "node-a"}
    assert expand(arg_value(compute, "--node-name"), pod) == "node-a"
    assert expand(arg_value(attention, "--node-name"), pod) == "node-a"
    assert expand(arg_value(compute, "--advertise-host"), pod) == "10.1.2.3"
    assert expand(arg_value(compute, "--instance-id"), pod) == "compute-7f9c-x2"
    router = main_container(one(docs, "Deployment", "router"))
    assert arg_value(router, "--manager") == "$(MANAGER_ADDRESS)"
    assert not [a for a in router["args"] if a.startswith("--compute")]  # discovery, not the static Service


@pytest.mark.parametrize("render", RENDERS)
def test_manager_role_grants_only_what_the_autoscaler_calls(rendered, render):
    docs = rendered[render]
    role = one(docs, "Role", "manager-autoscaler")
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["statefulsets/scale"],
            "resourceNames": ["attention"],
            "verbs": ["get", "patch"],
        }
    ]
    binding = one(docs, "RoleBinding", "manager-autoscaler")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "manager-autoscaler"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "manager", "namespace": NS}]
    assert one(docs, "ServiceAccount", "manager")["automountServiceAccountToken"] is False  # opted in by its pod
    manager = one(docs, "Deployment", "manager")
    assert manager["spec"]["template"]["spec"]["serviceAccountName"] == "manager"
    # The calls k8s_client makes are exactly those verbs on that subresource.
    calls = []

    class Api:
        def read_namespaced_stateful_set_scale(self, *args, **kwargs):
            calls.append(("get", args))
            return type("Scale", (), {"spec": type("Spec", (), {"replicas": 2})})()

        def patch_namespaced_stateful_set_scale(self, *args, **kwargs):
            calls.append(("patch", args[:2]))

    scaler = KubernetesScaler("attention", NS, Api())
    scaler.set_replicas(scaler.get_replicas() + 1)
    assert calls == [("get", ("attention", NS)), ("patch", ("attention", NS))]


def sources(docs: list[dict], rule: dict) -> list[str] | str:
    """Workloads a rule admits; ``"anyone"`` for a rule without ``from`` (any source)."""
    if "from" not in rule:
        return "anyone"
    return names([w for peer in rule["from"] for w in selected(docs, peer["podSelector"], NS)])


@pytest.mark.parametrize("render", RENDERS)
def test_managers_are_a_leader_and_hot_standbys_that_clients_reach_through_a_headless_service(rendered, render):
    """Every manager runs --standby and every client dials all of them (a headless Service behind dns:///), so
    calls reach whichever leads (client-side health checking, tests/services/manager/test_standby.py). A
    rollout starts the new pod before stopping an old one, and the replicas prefer different nodes."""
    docs = rendered[render]
    manager = one(docs, "Deployment", "manager")
    assert "--standby" in main_container(manager)["args"]
    assert manager["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert manager["spec"]["replicas"] == (1 if render == "dev" else 2)
    term = manager["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = term["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert names(selected(docs, term["labelSelector"], NS)) == ["manager"]
    assert one(docs, "Service", "manager")["spec"]["clusterIP"] == "None"
    address = config_data(docs, main_container(manager))["MANAGER_ADDRESS"]
    assert address == "dns:///manager:50050"
    for kind, name in (("StatefulSet", "attention"), ("Deployment", "compute"), ("Deployment", "router")):
        assert arg_value(main_container(one(docs, kind, name)), "--manager") == "$(MANAGER_ADDRESS)"


@pytest.mark.parametrize("render", RENDERS)
def test_network_policies_let_only_mesh_components_in(rendered, render):
    docs = rendered[render]
    got = {}
    for policy in by_kind(docs, "NetworkPolicy"):
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        target = names(selected(docs, spec["podSelector"], NS))
        got[policy["metadata"]["name"]] = (
            target,
            [(sources(docs, r), [p["port"] for p in r["ports"]]) for r in spec["ingress"]],
        )
    assert got == {
        # gRPC only from mesh components; the metrics port (no KV, no control) from any scraper.
        "attention": (["attention"], [(["attention", "compute", "manager"], ["grpc"]), ("anyone", ["metrics"])]),
        "compute": (["compute"], [(["manager", "router"], ["grpc"]), ("anyone", ["metrics"])]),
        "manager": (
            ["manager"],
            [(["attention", "compute", "manager", "router"], ["grpc"]), ("anyone", ["metrics"])],
        ),
        "etcd": (["etcd"], [(["etcd", "manager"], ["grpc"]), (["etcd"], ["peer"]), ("anyone", ["metrics"])]),
    }


@pytest.mark.parametrize("render", RENDERS)
def test_shared_settings_are_values_the_services_accept(rendered, render):
    docs = rendered[render]
    sts = one(docs, "StatefulSet", "attention")
    data = config_data(docs, main_container(sts))
    policy = ScalingConfig(
        int(data["ATTENTION_MIN_REPLICAS"]),
        int(data["ATTENTION_MAX_REPLICAS"]),
        float(data["SCALE_UP_BELOW"]),
        float(data["SCALE_DOWN_ABOVE"]),
        float(data["SCALE_UP_AFTER"]),
        float(data["SCALE_DOWN_AFTER"]),
        float(data["SCALE_COOLDOWN"]),
    )
    assert policy.min_replicas >= 1
    assert data["KV_DTYPE"] in KV_DTYPES and data["DTYPE"] in ("float32", "bfloat16")
    kv = parse_size(data["ATTENTION_KV_MEMORY"])
    # SmolLM2-135M (the default model): 30 layers, 3 KV heads, head_dim 64. The budget holds rBlocks of it.
    config = AttentionServerConfig(
        server_id="attention-0",
        kv_memory_bytes=kv,
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        dtype=data["KV_DTYPE"],
        block_size=int(data["BLOCK_SIZE"]),
    )
    assert kv // config.layout.bytes_per_block >= 16
    # Addresses name Services of the render, on their ports.
    for key in ("ETCD_ENDPOINT", "MANAGER_ADDRESS", "COMPUTE_ADDRESS", "ROUTER_ADDRESS"):
        # dns:/// = every pod of a headless Service; https:// = etcd's TLS (test_etcd_tls.py)
        host, port = data[key].removeprefix("dns:///").removeprefix("https://").split(":")
        assert int(port) in [p["port"] for p in one(docs, "Service", host)["spec"]["ports"]], key


@pytest.mark.parametrize("render", RENDERS)
def test_attention_memory_fits_its_kv_budget(rendered, render):
    """KV in host memory needs the pod's memory limit above it; KV on a GPU needs the GPU."""
    docs = rendered[render]
    c = main_container(one(docs, "StatefulSet", "attention"))
    data = config_data(docs, c)
    kv, limits = parse_size(data["ATTENTION_KV_MEMORY"]), c["resources"]["limits"]
    runtime = 512 << 20
    if data["ATTENTION_DEVICE"] == "cpu":
        assert "nvidia.com/gpu" not in limits
        assert parse_quantity(c["resources"]["requests"]["memory"]) >= kv + runtime
        assert parse_quantity(limits["memory"]) >= kv + runtime
    else:
        assert data["ATTENTION_DEVICE"] == "cuda" and limits["nvidia.com/gpu"] == "1"
        assert kv <= 40 * 10**9  # fits a 40 GB GPU


@pytest.mark.parametrize("render", RENDERS)
def test_the_manager_attention_servers_and_compute_instances_share_the_block_size(rendered, render):
    """The manager refuses a member whose block size is not its own (``check_block_size``): all three get
    ``BLOCK_SIZE`` from the config, so an overlay that changes it keeps the mesh able to register."""
    docs = rendered[render]
    for kind, name in (("Deployment", "manager"), ("StatefulSet", "attention"), ("Deployment", "compute")):
        assert arg_value(main_container(one(docs, kind, name)), "--block-size") == "$(BLOCK_SIZE)", name


@pytest.mark.parametrize("render", RENDERS)
def test_no_service_declares_cleartext_http2_on_an_mtls_port(rendered, render):
    """Every gRPC port is mutual TLS: ``appProtocol: kubernetes.io/h2c`` (HTTP/2 without TLS) would make a
    service mesh or a Gateway API implementation speak cleartext to it."""
    for svc in by_kind(rendered[render], "Service"):
        protocols = [p.get("appProtocol") for p in svc["spec"]["ports"]]
        assert "kubernetes.io/h2c" not in protocols, svc["metadata"]["name"]


@pytest.mark.parametrize("render", ["dev", "gpu", "gpu-host-memory"])
def test_the_tls_bootstrap_job_goes_away_after_it_finishes_so_a_later_apply_can_change_it(rendered, render):
    """A Job's pod template is immutable: kept, an image or version change fails the next apply."""
    job = one(rendered[render], "Job", "tls-bootstrap")
    assert 0 < job["spec"]["ttlSecondsAfterFinished"] <= 3600


@pytest.mark.parametrize("render", RENDERS)
def test_etcds_backend_quota_is_below_its_volume(rendered, render):
    """A database that grows hits etcd's quota (a NOSPACE alarm: writes refused, reads served) before the
    volume fills (a crash)."""
    sts = one(rendered[render], "StatefulSet", "etcd")
    env = {e["name"]: e.get("value") for e in main_container(sts)["env"]}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    volume = parse_quantity(claim["spec"]["resources"]["requests"]["storage"])
    assert 0 < int(env["ETCD_QUOTA_BACKEND_BYTES"]) <= 0.8 * float(volume)
