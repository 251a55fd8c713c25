"""Export to and import from a Hugging-Face-style model directory (weights only).

    <dir>/config.json          the model config (moontrain's ModelConfig fields) plus model_type,
                               architectures, torch_dtype and the step it was exported from
    <dir>/model.safetensors    every parameter and persistent buffer at its canonical (full) shape under
                               its state-dict name: expert projections as [E, in, out] (the E canonical
                               experts, never slot copies), router score biases as [E]

Values are copied bit for bit (fp32 masters, no casting), so export then import is the identity.
Optimizer state, RNG and data position are not part of it: an imported model starts a new run.

    python -m moontrain.checkpoint export runs/k3_tiny/checkpoints/step_00000060 exported/k3_tiny

    python -m moontrain.checkpoint.hf runs/k3_tiny/checkpoints/step_00000060 exported/k3_tiny
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors.torch import save_file

from moontrain.checkpoint.store import load_model_tensors, open_checkpoint
from moontrain.checkpoint.tensors import CheckpointError, Piece, TensorSource
from moontrain.dataclass_dict import from_dict
from moontrain.model.config import ModelConfig

if TYPE_CHECKING:
    from moontrain.checkpoint.state import TrainState

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
MODEL_TYPE = "moontrain_k3"


def export_hf(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the model weights of a checkpoint (any layout) as one full-shape safetensors file."""
    state, source = open_checkpoint(checkpoint)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name[len("model."):]: source.full(name).contiguous() for name in source.names()
               if name.startswith("model.")}
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    config = {"architectures": ["K3ForCausalLM"], "model_type": MODEL_TYPE, "torch_dtype": "float32",
              "moontrain_step": state["step"], **state["model"]}
    (out_dir / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return out_dir


def read_hf(model_dir: str | Path) -> tuple[ModelConfig, TensorSource]:
    """The model config and the weights of an exported directory (read on demand)."""
    model_dir = Path(model_dir)
    config_path, weights_path = model_dir / CONFIG, model_dir / WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise CheckpointError(f"model file {path} is missing")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"model file {config_path} is corrupt: {err}") from err
    if raw.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{config_path}: model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
    fields = set(ModelConfig.__dataclass_fields__)
    cfg = from_dict(ModelConfig, {k: v for k, v in raw.items() if k in fields}, "model")
    probe = TensorSource(model_dir, {})
    handle = probe._handle(WEIGHTS)
    index = {}
    for name in handle.keys():
        shape = tuple(handle.get_slice(name).get_shape())
        index[name] = (shape, [Piece(WEIGHTS, 0, shape[0] if shape else 0)])
    return cfg, TensorSource(model_dir, index)


def import_hf(run: TrainState, model_dir: str | Path) -> None:
    """Load exported weights into a run of the same model config (any EP / DP layout)."""
    cfg, source = read_hf(model_dir)
    if cfg != run.model_config:
        raise CheckpointError(f"{Path(model_dir) / CONFIG} describes another model than the recipe's model: section")
    load_model_tensors(run, source, prefix="")
