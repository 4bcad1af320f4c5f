"""Reading rendered manifests: workloads, their pod templates and containers, label selectors, env refs."""

from __future__ import annotations

import re
from collections.abc import Iterator

WORKLOAD_KINDS = ("Deployment", "StatefulSet")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def all_containers(workload: dict) -> Iterator[dict]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def main_container(workload: dict) -> dict:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: expected one container"
    return containers[0]


def matches(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels + matchExpressions In/NotIn/Exists/DoesNotExist) selects ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def selected(docs: list[dict], selector: dict, namespace: str | None) -> list[dict]:
    """Workloads of ``namespace`` whose pod template ``selector`` selects."""
    return [
        w for w in workloads(docs) if w["metadata"].get("namespace") == namespace and matches(selector, pod_labels(w))
    ]


def config_data(docs: list[dict], container: dict) -> dict[str, str]:
    """The data of every ConfigMap the container takes with ``envFrom`` (each must be in the render)."""
    data: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        data.update(one(docs, "ConfigMap", name)["data"])
    return data


def arg_value(container: dict, flag: str) -> str:
    """The value of ``--flag=value`` in the container's args (exactly one occurrence)."""
    values = [a.split("=", 1)[1] for a in container.get("args", []) if a.startswith(flag + "=")]
    assert len(values) == 1, f"{container['name']}: expected one {flag}=..., got {values}"
    return values[0]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion with ``env`` (unknown references stay as they are)."""
    return VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)
