"""Config: an OmegaConf structured config built from dataclasses, merged schema ← preset ← overrides."""

from ipuft.config.load import checkpoint_config, load_config, preset_names, to_yaml, with_values
from ipuft.config.safe_yaml import read_config_data
from ipuft.config.schema import Config
from ipuft.config.sections import ConfigSectionRegistry

__all__ = ["Config", "ConfigSectionRegistry", "checkpoint_config", "load_config", "preset_names", "read_config_data",
           "to_yaml", "with_values"]
