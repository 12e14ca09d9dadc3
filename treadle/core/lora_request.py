"""LoRARequest: which adapter a request runs with, as vLLM's (`vllm.lora.request`)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LORA_NAME_CHARS = 256  # an adapter's name, loaded live or bound to an API key


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """`lora_int_id` names the adapter in the engine (>= 1, one per distinct adapter);
    `lora_path`: its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
