"""Hugging Face-style checkpoint directories: ``config.json`` + ``*.safetensors``.

Loading checks the tensors against :func:`parameter_shapes` and names the tensor and
the file for anything missing, unexpected or mis-shaped; a checkpoint either loads
completely or not at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvxfer.engine.model_config import ConfigError, ModelConfig
from kvxfer.engine.weights import WeightsError, check_tensor_shapes

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"


class CheckpointError(WeightsError):
    """A checkpoint directory is missing, malformed, or does not match its config."""


def _check_tensors(found: dict[str, tuple[tuple[int, ...], str]], config: ModelConfig,
                   where: str) -> None:
    try:
        check_tensor_shapes(found, config, where)
    except WeightsError as exc:
        raise CheckpointError(str(exc)) from None


def save_checkpoint(directory: str | Path, config: ModelConfig,
                    state_dict: dict[str, torch.Tensor], tokenizer_json: str | None = None
                    ) -> Path:
    """Write ``config.json``, ``model.safetensors`` and optionally ``tokenizer.json``.

    ``state_dict`` must hold exactly the tensors :func:`parameter_shapes` names.
    Returns the directory.
    """
    path = Path(directory)
    _check_tensors({name: (tuple(t.shape), "state_dict") for name, t in state_dict.items()},
                   config, str(path))
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    save_file({name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()},
              str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    if tokenizer_json is not None:
        (path / TOKENIZER_FILE).write_text(tokenizer_json)
    return path


def load_config(directory: str | Path) -> ModelConfig:
    """Read and validate ``config.json`` of a checkpoint directory."""
    path = Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    try:
        return ModelConfig.from_hf(raw)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def load_checkpoint(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load config and every ``*.safetensors`` file in ``directory`` (CPU, stored dtypes)."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config = load_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        for name, tensor in _read_file(file).items():
            if name in where:
                raise CheckpointError(f"tensor {name!r} appears in both {where[name][1]} "
                                      f"and {file.name}")
            if _ignored(name, config):
                continue
            tensors[name] = tensor
            where[name] = (tuple(tensor.shape), file.name)
    _check_tensors(where, config, f"{path} [{', '.join(f.name for f in files)}]")
    return config, tensors


def _read_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from None


def _ignored(name: str, config: ModelConfig) -> bool:
    """Tensors some exporters write that carry nothing the model uses."""
    # Older exports store RoPE's inverse frequencies; they are recomputed from rope_theta.
    if name.endswith("rotary_emb.inv_freq"):
        return True
    # Tied models sometimes also save the shared matrix as lm_head.
    return name == "lm_head.weight" and config.tie_word_embeddings
