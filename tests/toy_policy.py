"""A queue policy from outside the package, loaded as a plugin (TREADLE_PLUGINS=toy_policy, with
tests/ on the path) by tests/test_plugins.py: shortest prompt first, and one setting, the
longest prompt it admits (longer ones are refused at once)."""

from __future__ import annotations

from dataclasses import dataclass

from treadle.config import SchedulerConfig, setting
from treadle.core.request import Request
from treadle.core.sched.policy import SchedulerView, SchedulingPolicy, register_policy


@dataclass(frozen=True)
class ToySettings:
    toy_max_prompt_tokens: int | None = setting(None, "under --policy toy, the longest prompt "
                                                "admitted; longer ones are refused",
                                                none="no limit")


@register_policy
class ShortestPromptFirst(SchedulingPolicy):
    name = "toy"
    summary = "shortest prompt first"
    settings_class = ToySettings

    def __init__(self, max_prompt_tokens: int | None) -> None:
        self.max_prompt_tokens = max_prompt_tokens

    @classmethod
    def from_config(cls, config: SchedulerConfig, settings: ToySettings) -> ShortestPromptFirst:
        return cls(settings.toy_max_prompt_tokens)

    def sort_key(self, request: Request) -> tuple:
        return (request.num_prompt_tokens, request.arrival_time)

    def refuse(self, request: Request, scheduler: SchedulerView) -> str | None:
        limit = self.max_prompt_tokens
        if limit is not None and request.num_prompt_tokens > limit:
            return f"prompts over {limit} tokens are refused"
        return None
