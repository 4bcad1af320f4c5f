"""Every workload of every render: probes on its port, resources, labels, non-root security, graceful stop,
images, ``$(VAR)`` references and CLI flags that the image's ``infinite-llm`` really accepts."""

from __future__ import annotations

import os

import pytest
from kubernetes.utils import parse_quantity

from infinite_llm.rpc.options import DRAIN_TIMEOUT_S, SHUTDOWN_GRACE_S

from .conftest import RENDERS
from .manifests import (
    VAR_REF,
    all_containers,
    config_data,
    main_container,
    pod_labels,
    pod_spec,
    workloads,
)

# component -> (workload kind, name, main container, named port, its number, probe kind)
COMPONENTS = {
    "state-store": ("StatefulSet", "etcd", "etcd", "grpc", 2379, "etcd"),
    "manager": ("Deployment", "manager", "manager", "grpc", 50050, "grpc"),
    "attention-server": ("StatefulSet", "attention", "attention-server", "grpc", 50060, "grpc"),
    "compute": ("Deployment", "compute", "compute", "grpc", 50070, "grpc"),
    "router": ("Deployment", "router", "router", "grpc", 50051, "grpc"),
    "gateway": ("Deployment", "gateway", "gateway", "http", 8000, "http"),
}
INSTANCE = {
    "dev": "infinite-llm-dev",
    "gpu": "infinite-llm-gpu",
    "production": "infinite-llm",
    "gpu-host-memory": "infinite-llm-gpu",
}
IMAGE = {
    "dev": "infinite-llm:dev",
    "gpu": "infinite-llm:0.1.0-cuda",
    "production": "infinite-llm:0.1.0",
    "gpu-host-memory": "infinite-llm:0.1.0-cuda",
}
# Seconds a service takes to stop after SIGTERM: its own drain (--shutdown-grace: gRPC's grace, or uvicorn's
# for the gateway); an attention server first waits for its rBlocks to migrate away (--drain-timeout).
DRAIN_S = {
    "manager": SHUTDOWN_GRACE_S,
    "attention-server": DRAIN_TIMEOUT_S + SHUTDOWN_GRACE_S,
    "compute": SHUTDOWN_GRACE_S,
    "router": SHUTDOWN_GRACE_S,
    "gateway": SHUTDOWN_GRACE_S,
    "state-store": 0,
}


def cases():
    return [(r, c) for r in RENDERS for c in COMPONENTS]


def workload_of(rendered, render: str, component: str) -> dict:
    found = [w for w in workloads(rendered[render]) if pod_labels(w)["app.kubernetes.io/component"] == component]
    assert len(found) == 1, f"{render}: {len(found)} workloads of component {component}"
    return found[0]


def test_each_render_has_exactly_the_six_workloads(rendered):
    for render in RENDERS:
        got = sorted((w["kind"], w["metadata"]["name"]) for w in workloads(rendered[render]))
        assert got == sorted((kind, name) for kind, name, *_ in COMPONENTS.values())


@pytest.mark.parametrize("render,component", cases())
def test_probes_target_the_service_port(rendered, render, component):
    kind, name, container_name, port_name, port, probe_kind = COMPONENTS[component]
    w = workload_of(rendered, render, component)
    assert (w["kind"], w["metadata"]["name"]) == (kind, name)
    c = main_container(w)
    assert c["name"] == container_name
    named = [p for p in c["ports"] if p["name"] == port_name]
    assert [p["containerPort"] for p in named] == [port]
    # STYLE.md: one named grpc port (etcd also has its peer port, and /health and /metrics in plaintext on
    # its "metrics" port; the gateway speaks HTTP and serves /metrics on it); every other service also serves
    # Prometheus /metrics on its own "metrics" port, and grpc.health.v1 in plaintext on its "health" port
    # (its grpc port demands a client certificate, which kubelet lacks).
    expected = {"state-store": ["grpc", "peer", "metrics"], "gateway": [port_name]}.get(
        component, [port_name, "metrics", "health"]
    )
    assert [p["name"] for p in c["ports"]] == expected
    if "metrics" in expected and component != "state-store":
        assert "--metrics-port=$(METRICS_PORT)" in c["args"]
    probe_port = port
    if "health" in expected:
        probe_port = int(config_data(rendered[render], c)["INFINITE_LLM_HEALTH_PORT"])
        assert [p["containerPort"] for p in c["ports"] if p["name"] == "health"] == [probe_port]
    probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    if probe_kind == "grpc":
        for kind_, probe in probes.items():
            assert probe["grpc"] == {"port": probe_port}, f"{kind_}: native gRPC probe on {probe_port}"
    elif probe_kind == "etcd":  # its client port is TLS with client certificates: /health on the metrics port
        for kind_, probe in probes.items():
            assert probe["httpGet"]["port"] == "metrics", kind_
            assert probe["httpGet"]["path"].startswith("/health?"), kind_
    else:
        assert probes["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert probes["startupProbe"]["tcpSocket"] == probes["livenessProbe"]["tcpSocket"] == {"port": "http"}
    # Startup covers loading: it allows longer than liveness would before killing.
    startup, liveness = probes["startupProbe"], probes["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    assert (
        startup["periodSeconds"] * startup["failureThreshold"]
        > liveness["periodSeconds"] * liveness["failureThreshold"]
    )


@pytest.mark.parametrize("render,component", cases())
def test_every_container_requests_and_limits_resources(rendered, render, component):
    for c in all_containers(workload_of(rendered, render, component)):
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        for resource in ("cpu", "memory"):
            assert parse_quantity(requests[resource]) > 0, (c["name"], resource)
            assert parse_quantity(requests[resource]) <= parse_quantity(limits[resource]), (c["name"], resource)
        for extended in set(requests) | set(limits):
            if "/" in extended:  # extended resources (GPUs) must be requested and limited alike
                assert requests.get(extended) == limits.get(extended), (c["name"], extended)


@pytest.mark.parametrize("render,component", cases())
def test_standard_labels_on_workload_and_pods(rendered, render, component):
    w = workload_of(rendered, render, component)
    name = "etcd" if component == "state-store" else "infinite-llm"
    expected = {
        "app.kubernetes.io/name": name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "infinite-llm",
        "app.kubernetes.io/managed-by": "kustomize",
        "app.kubernetes.io/version": "0.1.0",
        "app.kubernetes.io/instance": INSTANCE[render],
    }
    assert w["metadata"]["labels"] == expected
    assert pod_labels(w) == expected
    # Selectors are immutable: only the labels that never change between releases.
    assert w["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": name, "app.kubernetes.io/component": component}
    }


@pytest.mark.parametrize("render,component", cases())
def test_pods_run_as_non_root_without_privileges(rendered, render, component):
    w = workload_of(rendered, render, component)
    spec = pod_spec(w)
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] > 0 and pod["runAsGroup"] > 0 and pod["fsGroup"] == pod["runAsGroup"]
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    for c in all_containers(w):
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }, c["name"]
    # Only the manager talks to the Kubernetes API.
    assert spec["automountServiceAccountToken"] is (component == "manager")
    assert spec.get("serviceAccountName") == ("manager" if component == "manager" else None)


@pytest.mark.parametrize("render,component", cases())
def test_termination_grace_outlasts_the_drain(rendered, render, component):
    w = workload_of(rendered, render, component)
    c = main_container(w)
    pre_stop = c.get("lifecycle", {}).get("preStop")
    pause = int(pre_stop["exec"]["command"][1]) if pre_stop else 0
    if component != "state-store":  # the etcd image has no shell or sleep: it drains on SIGTERM itself
        assert pre_stop == {"exec": {"command": ["sleep", "5"]}}
    assert pod_spec(w)["terminationGracePeriodSeconds"] >= pause + DRAIN_S[component] + 10


@pytest.mark.parametrize("render,component", cases())
def test_images_come_from_the_overlay(rendered, render, component):
    w = workload_of(rendered, render, component)
    images = {c["image"] for c in all_containers(w)}
    assert images == ({"quay.io/coreos/etcd:v3.5.17"} if component == "state-store" else {IMAGE[render]})


@pytest.mark.parametrize("render,component", cases())
def test_every_variable_reference_is_defined(rendered, render, component):
    """``$(VAR)`` in args and env values must name an env var of the container, or Kubernetes passes it as is."""
    for c in all_containers(workload_of(rendered, render, component)):
        known = set(config_data(rendered[render], c))
        for e in c.get("env", []):
            for ref in VAR_REF.findall(e.get("value", "")):
                assert ref in known, f"{c['name']}: env {e['name']} uses $({ref}) before it is defined"
            known.add(e["name"])
        for arg in c.get("args", []) + c.get("command", []):
            for ref in VAR_REF.findall(arg):
                assert ref in known, f"{c['name']}: {arg!r} uses undefined $({ref})"


def serve_options(role: str, flags_only: bool = False) -> set[str]:
    """The options of ``serve ROLE`` (``flags_only``: those that take no value, such as ``--standby``)."""
    from typer.main import get_command

    from infinite_llm.cli import app

    serve = get_command(app).commands["serve"]
    params = serve.commands[role].params
    return {opt for p in params if not flags_only or getattr(p, "is_flag", False) for opt in p.opts}


@pytest.mark.parametrize("render,component", [c for c in cases() if c[1] != "state-store"])
def test_args_are_a_real_serve_command(rendered, render, component):
    c = main_container(workload_of(rendered, render, component))
    assert "command" not in c  # the image's entrypoint is `infinite-llm`
    role = {"attention-server": "attention"}.get(component, component)
    assert c["args"][:2] == ["serve", role]
    options = serve_options(role)
    flags = [a.split("=", 1)[0] for a in c["args"][2:]]
    bare = [a for a in c["args"][2:] if "=" not in a]  # only a flag may come without a value
    assert all(a.startswith("--") for a in c["args"][2:]) and set(bare) <= serve_options(role, True), c["args"]
    assert sorted(set(flags) - options) == [], f"unknown flags for `serve {role}`"
    assert len(flags) == len(set(flags))
    assert "--host=0.0.0.0" in c["args"]


@pytest.mark.parametrize("render,component", [c for c in cases() if c[1] not in ("state-store", "manager")])
def test_model_users_get_the_model_from_the_init_step(rendered, render, component, default_model_path):
    w = workload_of(rendered, render, component)
    spec, c = pod_spec(w), main_container(w)
    assert "--model=$(MODEL)" in c["args"]
    (init,) = spec["initContainers"]
    assert (init["name"], init["command"]) == ("fetch-model", ["fetch-model"])
    assert init["image"] == c["image"] and init["envFrom"] == c["envFrom"]
    data = config_data(rendered[render], c)
    assert data["MODEL"].startswith(data["MODEL_PACKAGES_DIR"] + "/")
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    init_mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert mounts["models"]["mountPath"] == init_mounts["models"]["mountPath"] == "/models"
    assert data["MODEL_PACKAGES_DIR"].startswith("/models/")
    assert mounts["models"]["readOnly"] is True and "readOnly" not in init_mounts["models"]
    cache = data["INFINITE_LLM_MODEL_CACHE"]
    assert mounts["model-cache"]["mountPath"] == init_mounts["model-cache"]["mountPath"] == cache
    volumes = {v["name"]: v for v in spec["volumes"] if v["name"] != "tls"}  # tls: the role's Secret (test_tls.py)
    assert set(volumes) == {"models", "model-cache", "tmp"}
    assert all("emptyDir" in v for v in volumes.values())
    # The scheduler counts the disk those emptyDirs fill: at least the model package, pip's unpacking of it
    # and a copy in the cache (3x the model file), or pods land on nodes short of disk and are evicted.
    disk = parse_quantity(c["resources"]["requests"]["ephemeral-storage"])
    assert disk >= 3 * os.path.getsize(default_model_path), component


@pytest.mark.parametrize("render", RENDERS)
def test_the_compute_model_cache_holds_the_weights_in_their_dtype(rendered, render, default_model_path):
    """The compute instance keeps its dequantized weights (``weights-<DTYPE>.safetensors``, registry.py) in
    the model-cache emptyDir: a sizeLimit below them gets the pod evicted, again at every restart (it was
    256Mi for 513 MiB of SmolLM2 in float32). Room for the weights plus 10%."""
    import gguf
    import torch

    w = workload_of(rendered, render, "compute")
    dtype = getattr(torch, config_data(rendered[render], main_container(w))["DTYPE"])
    elements = sum(int(t.n_elements) for t in gguf.GGUFReader(default_model_path).tensors)
    (cache,) = [v for v in pod_spec(w)["volumes"] if v["name"] == "model-cache"]
    assert parse_quantity(cache["emptyDir"]["sizeLimit"]) >= 1.1 * elements * dtype.itemsize


@pytest.mark.parametrize("render", RENDERS)
def test_a_manager_leaves_a_lost_node_in_30_seconds(rendered, render):
    """With one manager replica (dev), Kubernetes' default 300 s of tolerated node loss would stall placement
    for five minutes after a node failure; the manager's pod asks for 30 s (with two, the standby leads after
    the lost leader's 10 s session lease, and the replacement pod is the next standby)."""
    spec = pod_spec(workload_of(rendered, render, "manager"))
    tolerated = {t["key"]: t for t in spec.get("tolerations", []) if t.get("effect") == "NoExecute"}
    for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"):
        assert tolerated[key]["operator"] == "Exists" and tolerated[key]["tolerationSeconds"] <= 30
