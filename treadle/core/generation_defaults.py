"""Sampling defaults from a model's generation_config.json (`--generation-config`), for requests
that leave those fields out, as vLLM's `--generation-config auto` does."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json's keys that are SamplingParams fields of the same name (vLLM's set;
# its max_new_tokens is left out: the APIs' max_tokens defaults stand).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_folder: Path, generation_config: str) -> dict[str, Any]:
    """The SamplingParams fields to use where a request sets none: from `model_folder`'s
    generation_config.json ("auto"), none ("vllm"), or from that file in the folder
    `generation_config` names. ValueError for a folder without a readable one."""
    if generation_config == "vllm":
        return {}
    folder = model_folder if generation_config == "auto" else Path(generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config == "auto":  # a model may have none
            return {}
        raise ValueError(f"generation_config {generation_config!r}: no generation_config.json "
                         f"in that folder")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {str(path)!r}: {e}") from None
    defaults = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}
    if defaults:
        logger.info("sampling defaults from %s (requests that set a field override it): %s",
                    path, defaults)
    return defaults
