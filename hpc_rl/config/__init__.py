"""The run config: typed sections (`schema`), YAML/CLI loading (`loading`), validation, model files."""

from hpc_rl.config.loading import load_config, load_resolved_config, write_resolved_config
from hpc_rl.config.plugin_args import plugin_args
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.typing_rules import ConfigError

__all__ = ["ConfigError", "RunConfig", "load_config", "load_resolved_config", "plugin_args", "write_resolved_config"]
