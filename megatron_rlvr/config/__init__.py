"""The run config: every section's dataclass composed into one `Config` (run.py), read from YAML recipes and dotted
overrides with every key, type and declared limit checked once (loader.py), the rules between fields in one table
(rules.py), the sections of no wing (sections.py), the keys that moved (renamed.py), and `megatron-rlvr config
explain` (explain.py).
"""

from megatron_rlvr.config.loader import (
    apply_overrides,
    config_of,
    differences,
    dump_config,
    from_dict,
    load_config,
    parse_override,
    to_dict,
)
from megatron_rlvr.config.renamed import upgraded
from megatron_rlvr.config.run import Config
from megatron_rlvr.config.sections import ClusterConfig, TrainerConfig
from megatron_rlvr.errors import ConfigError

__all__ = [
    "ClusterConfig",
    "Config",
    "ConfigError",
    "TrainerConfig",
    "apply_overrides",
    "config_of",
    "differences",
    "dump_config",
    "from_dict",
    "load_config",
    "parse_override",
    "to_dict",
    "upgraded",
]
