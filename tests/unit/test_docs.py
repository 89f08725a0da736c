"""The documents quote what works: the README's quick-start spec is the tiny job that
``tests/integration/test_erld.py`` runs, and every `erl` command the docs quote parses with the CLI's own
parser. (The reference pages' freshness and the site's strict build are `make lint`'s.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from elastic_rl.cli.main import build_parser
from elastic_rl.spec.loading import load_spec
from tests.processes import SPEC

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
SHELL_BLOCKS = ("sh", "console", "bash", "shell", "")
FENCE = re.compile(r"^```(\w*)\s*$")


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def code_blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """Each fenced block of a markdown file: its language, first line number and lines."""
    blocks, language, start, lines = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line.strip())
        if language is None and fence:
            language, start, lines = fence.group(1), number + 1, []
        elif language is not None and line.strip() == "```":
            blocks.append((language, start, lines))
            language = None
        elif language is not None:
            lines.append(line)
    return blocks


def quoted_erl_commands() -> list[tuple[str, str]]:
    """Every line of a shell block that runs `erl`, joined with its continuation lines."""
    found = []
    for path in documents():
        for language, start, lines in code_blocks(path):
            if language not in SHELL_BLOCKS:
                continue
            command, first = "", 0
            for offset, line in enumerate(lines):
                text = line.strip()
                if command:
                    command += " " + text.rstrip("\\")
                elif text.startswith("erl "):
                    command, first = text.rstrip("\\"), start + offset
                if command and not text.endswith("\\"):
                    found.append((f"{path.relative_to(ROOT)}:{first}", command))
                    command = ""
    return found


def test_the_docs_quote_erl_commands():
    assert len(quoted_erl_commands()) >= 20


@pytest.mark.parametrize(("where", "command"), quoted_erl_commands(), ids=[where for where, _ in quoted_erl_commands()])
def test_every_quoted_erl_command_parses(where, command):
    words = shlex.split(command, comments=True)
    try:
        build_parser().parse_args(words[1:])
    except SystemExit as exc:  # argparse's way to refuse
        pytest.fail(f"{where}: `{command}` does not parse (exit {exc.code})")


def test_the_readme_quick_start_spec_is_the_tiny_job_the_suite_runs():
    name = SPEC.relative_to(ROOT).as_posix()
    blocks = [lines for language, _, lines in code_blocks(ROOT / "README.md") if language == "yaml"]
    shown = [lines for lines in blocks if lines and lines[0].strip() == f"# {name}"]
    assert shown, f"README.md shows no yaml block starting with '# {name}'"
    # The block is the file, after its first line naming it.
    assert "\n".join(shown[0][1:]) + "\n" == SPEC.read_text()
    assert load_spec(SPEC).name == "tiny-grpo"
