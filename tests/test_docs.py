"""The reference pages stay true: docs/cli.md's generated tables and example settings files, and every link."""

import re
import subprocess
import sys

from conftest import ROOT, mpi_env


def test_cli_reference_tables_and_examples_match_the_code():
    proc = subprocess.run(
        [sys.executable, "docs/cli_keys.py", "--check"],
        cwd=ROOT,
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def prose(path) -> str:
    """A Markdown file without its fenced code blocks (their ``#`` lines are comments, not headings)."""
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.S)


def anchors(path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in prose(path).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
    return out


def test_every_relative_link_of_the_readme_and_docs_resolves():
    """Every ``[text](path#anchor)`` of README.md and docs/*.md names a file of the repository
    and, with an anchor, one of its headings."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []
