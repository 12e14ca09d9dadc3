"""The settings a simulation runs under: each replica's engine config (the server's settings:
their names, defaults and checks are treadle/config.py's) and the sim's own (`SimOptions`)."""

from __future__ import annotations

from dataclasses import Field, asdict, dataclass, fields
from typing import Any

from treadle.config import (
    ROUTER_NAMES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    build_config,
    checked_value,
    policy_setting_fields,
    setting,
    setting_fields,
)

# SmolLM2-135M's KV bytes per token slot: layers x (K, V) x KV heads x one head's vector, in
# bfloat16 (auto on the CPU), float32 or, for an int8 cache, a byte an element plus a float32
# scale (model/memory.py's kv_bytes_per_token, which needs torch).
DEFAULT_KV_BYTES_PER_TOKEN = {"auto": 30 * 2 * 3 * 64 * 2, "bfloat16": 30 * 2 * 3 * 64 * 2,
                              "float32": 30 * 2 * 3 * 64 * 4, "int8": 30 * 2 * 3 * (64 + 4)}
# The engine's max_model_len None reads the model's own; the sim's model is the profile's, by
# default SmolLM2-135M, whose context this is.
DEFAULT_MAX_MODEL_LEN = 8192
# SmolLM2-135M's ModelSpec.attention_break_even (which needs the model's files).
DEFAULT_ATTENTION_BREAK_EVEN = 3073


@dataclass(frozen=True)
class SimOptions:
    """What the sim settles itself: the KV cache's size when num_blocks is not given (the engine
    sizes it from free memory, which the sim has none of), how often proposed tokens are
    accepted (the engine learns it from the model), and the replicas and their router."""

    kv_cache_memory: float = setting(1.0, "GiB of KV cache per replica, when --num-blocks is "
                                     "not given")
    bytes_per_block: int | None = setting(None, "KV bytes of one block",
                                          none="the default model's, bfloat16 or int8 as "
                                          "--kv-cache-dtype says")
    spec_acceptance: float = setting(0.7, "with --speculative-config: the chance that each "
                                     "proposed token is accepted, until the first rejection")
    attention_break_even: int = setting(
        DEFAULT_ATTENTION_BREAK_EVEN, "the model's context (positions) at which a prompt "
        "token's attention costs as many FLOPs as its matmuls: fair share weighs long prompts' "
        "chunks by it (0: not at all; the default model's)")
    replicas: int = setting(1, "engine replicas, each with its own KV cache")
    # Not the server's prefix: an even split, whatever the prompts.
    router: str = setting("round-robin", "how a request's replica is picked",
                          choices=ROUTER_NAMES)

    def __post_init__(self) -> None:
        if self.attention_break_even < 0:
            raise ValueError(f"attention_break_even must be >= 0, got {self.attention_break_even}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTER_NAMES:
            raise ValueError(f"router must be one of {ROUTER_NAMES}, got {self.router!r}")
        if not 0 <= self.spec_acceptance <= 1:
            raise ValueError(f"spec_acceptance must be in [0, 1], got {self.spec_acceptance}")
        if not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")


SIM_OPTION_TYPES = {f.name: f.type for f in fields(SimOptions)}


def engine_setting_fields() -> dict[str, Field]:
    """The engine settings that shape a simulated replica's batches, by name: the scheduler's,
    the policy and the registered policies' settings, the KV cache's, whether LoRA adapters
    are served (the model's other settings and the executor's have nothing to act on here)."""
    everything = setting_fields(EngineConfig)
    names = [*setting_fields(SchedulerConfig), "policy", *policy_setting_fields(), "block_size",
             "num_blocks", "enable_prefix_caching", "max_model_len", "kv_cache_dtype",
             "speculative_config", "enable_lora"]
    return {name: everything[name] for name in names}


def sim_setting_fields() -> dict[str, Field]:
    """Every setting a simulation takes, by name: the engine's, then the sim's own."""
    return {**engine_setting_fields(), **{f.name: f for f in fields(SimOptions)}}


class SimSettings:
    """One simulated deployment from flat settings, as `LLM(...)` takes them: the engine's (any
    of EngineConfig's; num_blocks None: as many as `kv_cache_memory` holds; max_model_len
    None: the default model's) and the sim's own (SimOptions). ValueError naming a bad one."""

    def __init__(self, **settings: Any) -> None:
        self.given = settings
        own = {name: settings[name] for name in settings if name in SIM_OPTION_TYPES}
        self.options = SimOptions(**{name: checked_value(name, value, SIM_OPTION_TYPES[name])
                                     for name, value in own.items()})
        engine = {name: value for name, value in settings.items() if name not in own}
        if engine.get("num_blocks") is None:
            block_size = engine.get("block_size") or CacheConfig().block_size
            # An unknown dtype is refused by build_config below, naming the setting.
            per_token = DEFAULT_KV_BYTES_PER_TOKEN.get(engine.get("kv_cache_dtype", "auto"),
                                                       DEFAULT_KV_BYTES_PER_TOKEN["auto"])
            per_block = self.options.bytes_per_block or block_size * per_token
            engine["num_blocks"] = max(1, int(self.options.kv_cache_memory * (1 << 30))
                                       // per_block)
        if engine.get("max_model_len") is None:
            engine["max_model_len"] = DEFAULT_MAX_MODEL_LEN
        self.engine: EngineConfig = build_config(EngineConfig, engine)

    @property
    def replicas(self) -> int:
        return self.options.replicas

    @property
    def router(self) -> str:
        return self.options.router

    def replace(self, **changes: Any) -> SimSettings:
        return SimSettings(**{**self.given, **changes})

    def as_dict(self) -> dict[str, Any]:
        """Every setting the simulation ran under, by name (for reports)."""
        flat = {name: value for section in (self.engine.scheduler, self.engine.cache,
                                            self.engine.policy_settings)
                if section is not None for name, value in asdict(section).items()}
        values = {**flat, "policy": self.engine.policy,
                  "max_model_len": self.engine.model.max_model_len,
                  "enable_lora": self.engine.model.enable_lora, **asdict(self.options)}
        return {name: values[name] for name in sim_setting_fields() if name in values}


def parse_setting(name: str, text: str) -> object:
    """A setting's value from text (for --sweep NAME=v1,v2)."""
    known = sim_setting_fields()
    if name not in known:
        raise ValueError(f"unknown setting {name!r}; one of {sorted(known)}")
    kind = known[name].type
    if kind == "str":
        return text
    if kind == "bool":
        return text.lower() in ("1", "true", "on", "yes")
    if text.lower() == "none" and kind.endswith("| None"):
        return None
    if kind.startswith("float"):
        return float(text)
    return int(text)
