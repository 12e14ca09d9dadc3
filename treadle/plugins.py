"""Plugins: modules from outside the package that extend it as they are imported (a queue
policy registers itself: treadle/core/sched/policy.py `register_policy`), named in
TREADLE_PLUGINS (comma-separated module names, importable from the process's path). Each
process imports them before it builds a config or an engine: the CLI, `LLM(...)`,
`AsyncLLM(...)` and the engine core (in the engine process, or a data-parallel replica), as vLLM
loads its general plugins."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

PLUGINS_VARIABLE = "TREADLE_PLUGINS"


def load_plugins(environ: Mapping[str, str] | None = None) -> list[str]:
    """Import the modules TREADLE_PLUGINS names (once each: Python caches imports); returns
    their names. ImportError naming the variable for one that cannot be imported."""
    text = (os.environ if environ is None else environ).get(PLUGINS_VARIABLE, "")
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ImportError(f"{PLUGINS_VARIABLE}: cannot import {name!r}: {e}") from e
    return names
