"""Strict YAML <-> dataclass configs: each component owns its config, the run config composes them."""

from moontrain.config.loader import apply_overrides, dump_config, from_dict, load_recipe
from moontrain.config.run_config import RunConfig

__all__ = ["RunConfig", "apply_overrides", "dump_config", "from_dict", "load_recipe"]
