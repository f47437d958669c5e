"""docs/configuration.md, generated from the config dataclasses: every key, its type, default and the
comment beside it in jtopoep/config.py. `python -m jtopoep.config_docs > docs/configuration.md`
rewrites it; a test fails when the file and the dataclasses disagree."""

from __future__ import annotations

import dataclasses
import inspect
import re

from jtopoep import config

SECTIONS = {"topology": config.TopologyConfig, "model": config.ModelConfig, "moe": config.MoEConfig,
            "train": config.TrainConfig, "data": config.DataConfig}
_FIELD = re.compile(r"^    (\w+): [^=#]+(?:=[^#]*)?(?:#\s*(.*))?$")
_COMMENT = re.compile(r"^    #\s?(.*)$")

HEADER = """# Configuration

A run file (`configs/*.yaml`) has five sections. `topology` and `model` may name a preset from
`configs/topologies/` or `configs/models/` (`preset: h800-4x8`) and override any of its keys. Every key
is typed and checked when the file is loaded: an unknown key, a wrong type, a value out of range or an
inconsistent combination stops the run with the key, the value and what is allowed. Override any key
on the command line with `--set section.key=value` (repeatable).

This page is generated from `jtopoep/config.py` (`python -m jtopoep.config_docs`); a test keeps the two
in step.
"""


def field_comments(cls) -> dict[str, str]:
    """{field: its comment}: the comment lines just above a field, then the one beside it."""
    comments, pending = {}, []
    for line in inspect.getsource(cls).splitlines():
        if match := _COMMENT.match(line):
            pending.append(match.group(1).strip())
        elif match := _FIELD.match(line):
            comments[match.group(1)] = " ".join(pending + [match.group(2) or ""]).strip()
            pending = []
        else:
            pending = []
    return comments


def _default(field: dataclasses.Field) -> str:
    if field.default is dataclasses.MISSING:
        return "required"
    return f"`{field.default!r}`" if not isinstance(field.default, str) else f"`{field.default}`"


def markdown() -> str:
    out = [HEADER]
    for section, cls in SECTIONS.items():
        comments = field_comments(cls)
        out += [f"## `{section}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for field in dataclasses.fields(cls):
            kind = (field.type if isinstance(field.type, str) else field.type.__name__).replace("|", "or")
            meaning = comments.get(field.name, "").replace("|", "\\|")
            out.append(f"| `{field.name}` | {kind} | {_default(field)} | {meaning} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
