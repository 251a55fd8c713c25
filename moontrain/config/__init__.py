"""Strict YAML <-> dataclass configs: each component owns its config, the run config composes them; the
training loop's own sections (train:, eval:) live here too, so the trainer reads config and never the reverse."""

from moontrain.config.loader import apply_overrides, dump_config, from_dict, load_recipe
from moontrain.config.run_config import RunConfig

__all__ = ["RunConfig", "apply_overrides", "dump_config", "from_dict", "load_recipe"]
