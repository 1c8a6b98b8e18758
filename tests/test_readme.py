"""The README is the project's front door: short, naming every shipped preset, its docs/ links alive, and its
first ```bash block the Quickstart command that .ci/run extracts and runs in a fresh venv.

Each check is a function over the README's text that returns what is wrong, so that the tests can show it
failing on a README made wrong on purpose as well as passing on the real one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250
# The pages the issue moved out of the README: each must stay reachable from it.
REQUIRED_PAGES = ("docs/config.md", "docs/data.md", "docs/parallel.md", "docs/precision.md", "docs/how-a-step-runs.md",
                  "docs/performance.md", "docs/plugins.md")
DOCS_LINK = re.compile(r"\]\((docs/[^)#\s]*)(?:#[^)\s]*)?\)")


def shipped_presets() -> list[str]:
    """The presets the installed package ships (``ipuft.presets``' YAML files), not the checkout's listing."""
    return sorted(entry.name[: -len(".yaml")] for entry in resources.files("ipuft.presets").iterdir()
                  if entry.name.endswith(".yaml"))


def first_bash_block(text: str) -> str:
    """The lines of the first ```bash block, as .ci/run's awk reads them (a line that is exactly ```bash opens
    it, one that is exactly ``` closes it)."""
    lines, inside = [], False
    for line in text.splitlines():
        if not inside:
            inside = line == "```bash"
        elif line == "```":
            break
        else:
            lines.append(line)
    return "\n".join(lines)


def too_long(text: str) -> list[str]:
    count = len(text.splitlines())
    return [f"README has {count} lines, more than {MAX_LINES}"] if count > MAX_LINES else []


def unnamed_presets(text: str, presets: list[str]) -> list[str]:
    """Presets the README never names in backticks (a bare word such as "tiny" is not naming the preset)."""
    return [f"preset {name} is not named in the README" for name in presets if f"`{name}`" not in text]


def dead_docs_links(text: str, root: Path) -> list[str]:
    return [f"README links {target}, which does not exist" for target in DOCS_LINK.findall(text)
            if not (root / target).is_file()]


def missing_pages(text: str) -> list[str]:
    linked = set(DOCS_LINK.findall(text))
    return [f"README does not link {page}" for page in REQUIRED_PAGES if page not in linked]


def quickstart_problems(text: str) -> list[str]:
    first = first_bash_block(text)
    return [] if "ipuft train" in first else [f"README's first ```bash block is not the train command: {first!r}"]


def test_readme_is_short():
    assert too_long(README.read_text(encoding="utf-8")) == []
    assert too_long("line\n" * MAX_LINES) == []
    assert too_long("line\n" * (MAX_LINES + 1)) == [f"README has {MAX_LINES + 1} lines, more than {MAX_LINES}"]


def test_every_shipped_preset_is_named():
    presets = shipped_presets()
    # The five the package ships today; a preset added later is then checked as well.
    assert {"tiny", "small-cpu", "gptj-6b", "llama3-8b", "mistral-7b"} <= set(presets)
    assert unnamed_presets(README.read_text(encoding="utf-8"), presets) == []
    assert unnamed_presets("a tiny model: `small-cpu`", ["tiny", "small-cpu"]) == ["preset tiny is not named in the README"]


def test_docs_links_point_to_files(tmp_path):
    text = README.read_text(encoding="utf-8")
    assert dead_docs_links(text, ROOT) == []
    assert missing_pages(text) == []
    assert len(set(DOCS_LINK.findall(text))) >= len(REQUIRED_PAGES)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "data.md").write_text("# Data\n")
    bad = "[data](docs/data.md#packing) and [gone](docs/gone.md)"
    assert dead_docs_links(bad, tmp_path) == ["README links docs/gone.md, which does not exist"]
    assert missing_pages(bad) == [f"README does not link {page}" for page in REQUIRED_PAGES if page != "docs/data.md"]


def test_first_bash_block_is_the_train_command():
    text = README.read_text(encoding="utf-8")
    assert quickstart_problems(text) == []
    assert "pip install" in first_bash_block(text)
    swapped = "```bash\npython -m pytest\n```\n\n```bash\nipuft train\n```\n"
    assert quickstart_problems(swapped) == ["README's first ```bash block is not the train command: 'python -m pytest'"]
    assert first_bash_block("```text\nipuft train\n```\n```bash\nipuft plan\n```\n") == "ipuft plan"


@pytest.mark.skipif(shutil.which("awk") is None, reason="no awk")
def test_ci_run_extracts_the_same_command():
    """.ci/run's own awk program, taken from the script, finds the block this test reads."""
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    found = re.search(r"first=\$\(awk '([^']+)' README\.md\)", script)
    assert found, ".ci/run no longer extracts the README's first command with awk"
    extracted = subprocess.run(["awk", found.group(1), str(README)], capture_output=True, text=True, check=True).stdout
    assert extracted.rstrip("\n") == first_bash_block(README.read_text(encoding="utf-8"))
    assert "ipuft train" in extracted
