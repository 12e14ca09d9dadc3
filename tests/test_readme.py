"""The README's flag tables agree with `treadle serve --help`: every flag they name exists, and
each default they give is the one the help shows."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from treadle.cli import build_parser

README = Path(__file__).parent.parent / "README.md"
HEADER = "| flag | default | what |"
# How the README writes a default, by what argparse's help prints.
SPOKEN = {"False": "off", "True": "on", "": '""'}


def serve_flags() -> dict[str, str]:
    """Each `treadle serve` option -> the default its help shows."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {}
    for action in subparsers.choices["serve"]._actions:
        shown = re.search(r"\(default: (.*)\)$", " ".join((action.help or "").split()))
        for option in action.option_strings:
            flags[option] = shown[1] if shown else None
    return flags


def same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def readme_rows() -> list[tuple[list[str], list[str]]]:
    """(flags, defaults) of each row of the README's flag tables."""
    rows, in_table = [], False
    for line in README.read_text().splitlines():
        if line.strip() == HEADER:
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
        if in_table and not line.startswith("|---"):
            flag_cell, default_cell = (cell.strip() for cell in line.split(" | ")[:2])
            flags = re.findall(r"--[a-z][a-z0-9-]*", flag_cell)
            rows.append((flags, [d.strip().strip("`") for d in default_cell.split(",")]))
    return rows


def test_the_readme_has_flag_tables():
    assert len(readme_rows()) > 20


def test_every_flag_in_the_readme_tables_is_a_serve_flag_with_that_default():
    flags = serve_flags()
    wrong = []
    for names, defaults in readme_rows():
        # One default for each flag named, or one for all: --ssl-keyfile K --ssl-certfile C.
        shared = defaults * len(names) if len(defaults) == 1 else defaults
        for name, written in zip(names, shared, strict=True):
            if name not in flags:
                wrong.append(f"{name}: not a flag of treadle serve")
                continue
            shown = flags[name]
            if shown is None or shown.startswith(("the ", "one ", "measured", "not ", "no ")):
                continue  # a default in words; the README may word it its own way
            if written not in (shown, SPOKEN.get(shown)) and not same_number(written, shown):
                wrong.append(f"{name}: README says {written!r}, --help says {shown!r}")
    assert not wrong, "\n".join(wrong)
