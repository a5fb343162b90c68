"""One configuration tree for every command: dataclasses (sections.py), YAML and
`key.sub=value` overrides, one validate() (loading.py).

    cfg = load_config("examples/cpu-demo.yaml", ["rollout.gpu_memory_utilization=0.8"])

This package imports no torch: `handoff plan` uses it on a laptop.
"""

from handoff.config.loading import (dotted, load_config, read_section, reference, set_key,
                                    to_dict, validate)
from handoff.config.sections import (LORA_TARGETS, ActorConfig, Config, DataConfig, EvalConfig,
                                     HardwareConfig, LoraConfig, MemoryConfig, ModelConfig,
                                     ParallelConfig, RewardConfig, RolloutConfig, RunConfig,
                                     SyncConfig, WorkloadConfig)
from handoff.errors import ConfigError

__all__ = ["LORA_TARGETS", "ActorConfig", "Config", "ConfigError", "DataConfig", "EvalConfig",
           "HardwareConfig", "LoraConfig", "MemoryConfig", "ModelConfig", "ParallelConfig",
           "RewardConfig", "RolloutConfig", "RunConfig", "SyncConfig", "WorkloadConfig",
           "dotted", "load_config", "read_section", "reference", "set_key", "to_dict", "validate"]
