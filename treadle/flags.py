"""Settings as command-line flags: a setting's `--name-with-dashes`, its type, default and help,
all from its field in treadle/config.py. `treadle serve`, `treadle plan` and `treadle sim` build
their flags here, so that a setting is declared once whichever command takes it."""

from __future__ import annotations

import argparse
from dataclasses import Field
from typing import Any

from treadle.config import field_default, parse_bytes


def setting_flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def add_setting_flag(parser: argparse._ActionsContainer, f: Field, *,
                     default: Any = argparse.SUPPRESS, help: str | None = None,
                     flag: str | None = None, none: str | None = None,
                     **overrides: Any) -> argparse.Action:
    """The flag of setting `f`, its help ending in the setting's default. `default`: the value
    when the flag is absent (SUPPRESS, as `treadle serve` has it: absent flags stay out of the
    namespace, so a --config file's value stands); `help`: in place of the setting's own;
    `flag`: in place of its --name (where a command's own flag has that name); `none`: what
    a default of None means, in place of the setting's; `overrides`: argparse options (`dest`,
    `choices`, ...) in place of those the field implies."""
    meta = f.metadata
    options = {"dest": f.name, "default": default, **meta.get("flag", {})}
    aliases = options.pop("aliases", ())
    if "action" not in options:
        if "bool" in f.type:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = (parse_bytes if f.name.endswith("_bytes") else
                               float if "float" in f.type else
                               int if "int" in f.type else str)
    if meta.get("choices") is not None:
        options["choices"] = meta["choices"]
    text = help or meta.get("help", "")
    text = text() if callable(text) else text
    value = field_default(f)
    # None, or an empty list of names: what the setting says that means.
    shown = (none or meta.get("none", "none")) if value is None or value == () else value
    options["help"] = f"{text} (default: {shown})"
    options.update(overrides)
    return parser.add_argument(flag or setting_flag(f.name), *aliases, **options)


def has_flag(f: Field) -> bool:
    """Whether the setting has a flag of its own (a few are given by other flags)."""
    return not f.metadata.get("flag", {}).get("skip")
