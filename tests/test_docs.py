"""The README and docs/ say what the code does: the README's Python runs as written, the configuration
reference matches the config dataclasses, every local link resolves, and nothing reaches outside the
project."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from jtopoep import config_docs

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_readme_is_short_and_has_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert "make run" in text and "make test" in text
    # CI runs the README's test command.
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("index", range(len(python_blocks(README))))
def test_readme_python_runs_as_written(index, tmp_path):
    """Each block in a fresh interpreter (it sets up its own devices), from an empty folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", python_blocks(README)[index]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "imbalance" in out.stdout or "rank load" in out.stdout


def test_configuration_reference_matches_the_dataclasses():
    assert (ROOT / "docs" / "configuration.md").read_text() == config_docs.markdown(), (
        "docs/configuration.md is stale: python -m jtopoep.config_docs > docs/configuration.md")


def test_every_config_key_is_explained():
    for section, cls in config_docs.SECTIONS.items():
        comments = config_docs.field_comments(cls)
        for field in cls.__dataclass_fields__:
            assert comments.get(field), f"{section}.{field} has no comment in jtopoep/config.py"


@pytest.mark.parametrize("path", [README] + DOCS, ids=lambda p: p.name)
def test_local_links_resolve(path):
    for target in re.findall(r"\]\(([^)#]+)\)", path.read_text()):
        if "://" not in target:
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_nothing_reads_or_links_outside_the_project():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:  # not a git checkout: look at the files themselves
        tracked = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]
    offenders = []
    for name in tracked:
        if pathlib.Path(name).suffix in (".py", ".md", ".yaml", ".sh", ".toml") or name in ("Makefile", ".ci/run"):
            text = (ROOT / name).read_text(errors="replace")
            if re.search(r"\.\./shared|shared/(traces|DESIGN|STYLE)", text):
                offenders.append(name)
    assert not offenders, f"files reaching outside the project: {offenders}"
