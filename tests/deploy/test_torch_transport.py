"""The torch-transport component (deploy/k8s/components/torch-transport) on top of the dev (gloo on CPU) and
gpu (NCCL) overlays: both ends of a tensor channel run ``--transport=torch``, compute and attention pods may
reach each other on any port (the pair's TCPStore and gloo/NCCL use ephemeral ports), and no other pod gains
any access."""

from __future__ import annotations

import os
import shutil

import pytest

from infinite_llm.cli_options import transport_option

from .conftest import K8S, kustomize
from .manifests import arg_value, by_kind, main_container, one, pod_spec, selected
from .test_wiring import NS, names, sources


@pytest.fixture(scope="module", params=["dev", "gpu", "dev-own-list", "gpu-own-list"])
def with_component(request, kubectl, tmp_path_factory):
    """``(overlay, its documents, the same overlay with the component)``: the component on top of the rendered
    overlay, or (``-own-list``) in a copy of the overlay's own ``components`` list, as the README says to add it
    (there it comes before the overlay's patches)."""
    overlay, own_list = request.param.removesuffix("-own-list"), request.param.endswith("-own-list")
    root = tmp_path_factory.mktemp(f"torch-transport-{request.param}")
    if own_list:
        shutil.copytree(K8S / "overlays" / overlay, root, dirs_exist_ok=True)
        rel = os.path.relpath(K8S, root)
        text = (root / "kustomization.yaml").read_text()
        assert "  - ../../components/tls-bootstrap\n" in text
        text = text.replace("../../", f"{rel}/").replace(
            f"  - {rel}/components/tls-bootstrap\n",
            f"  - {rel}/components/tls-bootstrap\n  - {rel}/components/torch-transport\n",
        )
        (root / "kustomization.yaml").write_text(text)
    else:
        rel = os.path.relpath(K8S, root)  # kustomize takes relative paths only
        (root / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\n"
            "kind: Kustomization\n"
            f"namespace: {NS}\n"
            f"resources:\n  - {rel}/overlays/{overlay}\n"
            f"components:\n  - {rel}/components/torch-transport\n"
        )
    return overlay, kustomize(kubectl, K8S / "overlays" / overlay), kustomize(kubectl, root)


def _tensor_workloads(docs: list[dict]) -> list[dict]:
    return [one(docs, "Deployment", "compute"), one(docs, "StatefulSet", "attention")]


def test_both_ends_of_a_tensor_channel_run_the_torch_transport(with_component):
    _, before, after = with_component
    for workload in _tensor_workloads(after):
        assert transport_option(arg_value(main_container(workload), "--transport")) == "torch"
    for workload in _tensor_workloads(before):  # the overlays alone keep the default (gRPC, inside mTLS)
        assert not [a for a in main_container(workload)["args"] if a.startswith("--transport")]
    # Nothing else changes in the other workloads.
    for kind in ("Deployment", "StatefulSet"):
        for workload in by_kind(after, kind):
            if workload["metadata"]["name"] not in ("compute", "attention"):
                assert workload == one(before, kind, workload["metadata"]["name"])


def test_compute_and_attention_pods_reach_each_other_on_every_port_and_nobody_else_does(with_component):
    _, before, after = with_component
    policies = {p["metadata"]["name"]: p for p in by_kind(after, "NetworkPolicy")}
    old = {p["metadata"]["name"]: p for p in by_kind(before, "NetworkPolicy")}
    assert {name: policies[name] for name in old} == old  # the base policies stay as they were
    got = {}
    for name in set(policies) - set(old):
        spec = policies[name]["spec"]
        assert spec["policyTypes"] == ["Ingress"] and policies[name]["metadata"]["namespace"] == NS
        rules = spec["ingress"]
        assert all("ports" not in r for r in rules)  # every port: the store's and gloo/NCCL's are ephemeral
        got[name] = (names(selected(after, spec["podSelector"], NS)), [sources(after, r) for r in rules])
    assert got == {
        "attention-tensor-channels": (["attention"], [["compute"]]),
        "compute-tensor-channels": (["compute"], [["attention"]]),
    }


def test_nccl_gets_a_shared_memory_volume_larger_than_the_runtimes_64_mib(with_component):
    _, _, after = with_component
    for workload in _tensor_workloads(after):
        spec = pod_spec(workload)
        mounts = {m["mountPath"]: m["name"] for m in main_container(workload)["volumeMounts"]}
        volume = next(v for v in spec["volumes"] if v["name"] == mounts["/dev/shm"])
        assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
