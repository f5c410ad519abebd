"""The converted-model cache: each GGUF file dequantized once into a checkpoint directory.

Under ``$KVXFER_CACHE_DIR`` (else ``$XDG_CACHE_HOME/kvxfer``, else ``~/.cache/kvxfer``),
keyed by the file's identity and the conversion code. An entry is committed by one rename,
so a reader sees a complete entry or none.

Design: docs/design/models.md#the-converted-model-cache
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from functools import cache
from importlib.metadata import version
from pathlib import Path

from kvxfer.engine.checkpoint import CheckpointError, save_checkpoint
from kvxfer.engine.gguf import GGUFFile, read_config, read_weights

# Modules whose code decides what an entry holds.
_CONVERTER_MODULES = ("kvxfer.engine.gguf", "kvxfer.engine.gguf_tokenizer",
                      "kvxfer.engine.checkpoint", __name__)
_SAMPLE_BYTES = 1 << 20
_KEY_CHARS = 24
SOURCE_FILE = "source.txt"  # the resolved path of the GGUF an entry was converted from
# A temporary directory this old belongs to a conversion that died; it is removed.
_STALE_SECONDS = 3600


class ModelCacheError(CheckpointError):
    """The cache directory cannot be created or written; the message names it."""


def cache_dir() -> Path:
    """The cache root (not created here)."""
    if os.environ.get("KVXFER_CACHE_DIR"):
        return Path(os.environ["KVXFER_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "kvxfer"
    return Path.home() / ".cache" / "kvxfer"


@cache
def _converter_id() -> bytes:
    import kvxfer.engine.gguf_tokenizer  # noqa: F401  (imported lazily elsewhere)

    digest = hashlib.sha256(f"gguf {version('gguf')} tokenizers {version('tokenizers')}"
                            .encode())
    for module in _CONVERTER_MODULES:
        digest.update(Path(sys.modules[module].__file__ or "").read_bytes())
    return digest.digest()


def cache_key(gguf_path: str | Path) -> str:
    """Hex id of the file's identity (size, mtime, first and last MiB) and the converter's."""
    path = Path(gguf_path)
    stat = path.stat()
    digest = hashlib.sha256(_converter_id())
    digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    with path.open("rb") as handle:
        digest.update(handle.read(_SAMPLE_BYTES))
        handle.seek(max(stat.st_size - _SAMPLE_BYTES, 0))
        digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:_KEY_CHARS]


def entry_path(gguf_path: str | Path) -> Path:
    """Where the converted checkpoint of ``gguf_path`` lives (it may not exist yet)."""
    path = Path(gguf_path)
    return cache_dir() / "gguf" / f"{path.stem}-{cache_key(path)}"


def gguf_checkpoint(gguf_path: str | Path) -> Path:
    """The checkpoint directory converted from ``gguf_path``, converting it when absent."""
    entry = entry_path(gguf_path)
    if entry.is_dir():
        return entry
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(entry)
        building = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    except OSError as exc:
        raise ModelCacheError(f"cannot write the model cache {entry.parent}: {exc}; set "
                              f"KVXFER_CACHE_DIR to a writable directory") from None
    source = str(Path(gguf_path).resolve())
    try:
        convert_gguf(gguf_path, building)
        (building / SOURCE_FILE).write_text(source + "\n")
        try:
            building.rename(entry)
        except OSError:
            if not entry.is_dir():  # not a lost race: a real failure
                raise
    except OSError as exc:
        raise ModelCacheError(f"cannot write the model cache entry {entry}: {exc}") from None
    finally:
        shutil.rmtree(building, ignore_errors=True)
    _remove_other_versions(entry, Path(gguf_path).stem, source)
    return entry


def convert_gguf(gguf_path: str | Path, directory: Path) -> None:
    """Write the checkpoint directory of a GGUF file (its tokenizer files only when the
    file describes a tokenizer)."""
    from kvxfer.engine.gguf_tokenizer import build_tokenizer, tokenizer_config

    file = GGUFFile(gguf_path)
    config = read_config(file)
    weights = read_weights(file, config)
    has_tokenizer = file.get("tokenizer.ggml.model", str, None) is not None
    tokenizer_json = build_tokenizer(file).to_str() if has_tokenizer else None
    save_checkpoint(directory, config, weights, tokenizer_json)
    if has_tokenizer:
        (directory / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config(file), indent=2, ensure_ascii=False) + "\n")


def _remove_other_versions(entry: Path, stem: str, source: str) -> None:
    """Delete entries converted from the same file path with another key: an older
    version of that file, or an older converter. Entries of other files that share the
    name (another folder's ``model.gguf``) are kept. (A process still reading one keeps
    its open files; entries are never rewritten.)"""
    pattern = re.compile(re.escape(stem) + f"-[0-9a-f]{{{_KEY_CHARS}}}")
    for other in entry.parent.iterdir():
        if other == entry or not pattern.fullmatch(other.name):
            continue
        try:
            same_source = (other / SOURCE_FILE).read_text().strip() == source
        except FileNotFoundError:  # written before entries named their source
            same_source = True
        except OSError:
            continue
        if same_source:
            shutil.rmtree(other, ignore_errors=True)


def _remove_stale(entry: Path) -> None:
    """Delete temporary directories of conversions of ``entry`` that died long ago."""
    for stale in entry.parent.glob(f".tmp-{entry.name}-*"):
        try:
            if time.time() - stale.stat().st_mtime > _STALE_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            continue  # another process removed it first
