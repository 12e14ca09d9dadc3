"""The engine settings a simulation runs under (one replica's, times `replicas`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from treadle.config import ROUTER_NAMES, SchedulerConfig
from treadle.core.sched.policies import POLICIES


@dataclass(frozen=True)
class SimSettings:
    policy: str = "fcfs"
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 256
    max_num_partial_prefills: int = 4
    max_queue_wait: float | None = None
    max_kv_blocks_per_tenant: int | None = None
    fair_chunk_tokens: int | None = None
    block_size: int = 16
    num_blocks: int = 4096  # per replica
    enable_prefix_caching: bool = True
    max_model_len: int = 8192
    replicas: int = 1
    router: str = "round-robin"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.router not in ROUTER_NAMES:
            raise ValueError(f"router must be one of {ROUTER_NAMES}, got {self.router!r}")
        for name in ("block_size", "num_blocks", "max_model_len", "replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.scheduler_config()  # its own checks

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                               max_num_seqs=self.max_num_seqs,
                               long_prefill_token_threshold=self.long_prefill_token_threshold,
                               max_num_partial_prefills=self.max_num_partial_prefills,
                               max_queue_wait=self.max_queue_wait,
                               max_kv_blocks_per_tenant=self.max_kv_blocks_per_tenant,
                               fair_chunk_tokens=self.fair_chunk_tokens)


SETTING_TYPES = {f.name: f.type for f in fields(SimSettings)}


def parse_setting(name: str, text: str) -> object:
    """A setting's value from text (for --sweep NAME=v1,v2)."""
    kind = SETTING_TYPES.get(name)
    if kind is None:
        raise ValueError(f"unknown setting {name!r}; one of {sorted(SETTING_TYPES)}")
    if kind == "str":
        return text
    if kind == "bool":
        return text.lower() in ("1", "true", "on", "yes")
    if text.lower() == "none" and kind.endswith("| None"):
        return None
    if kind.startswith("float"):
        return float(text)
    return int(text)
