"""Checkpoints: per-rank safetensors shards under canonical names, atomic saves, resharding loads, HF export."""

from moontrain.checkpoint.config import CheckpointConfig
from moontrain.checkpoint.hf import export_hf, import_hf, init_weights_from, read_hf
from moontrain.checkpoint.store import find_latest, load_checkpoint, save_checkpoint
from moontrain.checkpoint.tensors import CheckpointError

__all__ = ["CheckpointConfig", "CheckpointError", "export_hf", "find_latest", "import_hf", "init_weights_from", "load_checkpoint",
           "read_hf", "save_checkpoint"]
