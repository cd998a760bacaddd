"""The reference pages stay true: docs/cli.md's generated tables and example settings files,
docs/hdf5.md's list of the results file's names, and every link."""

import re
import subprocess
import sys

from conftest import ROOT, mpi_env

from fedring import names


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


def test_hdf5_page_names_every_group_and_dataset_of_fedring_names():
    """docs/hdf5.md names each ``/name`` of :mod:`fedring.names` (``/aggregation/nonfinite`` on its
    own, not only as the start of ``/aggregation/nonfinite_update``)."""
    page = (ROOT / "docs" / "hdf5.md").read_text()
    named = {key: value for key, value in vars(names).items() if key.isupper()}
    assert len(named) > 10
    assert [key for key, value in named.items() if not re.search(rf"/{re.escape(value)}(?!\w)", page)] == []


def test_the_round_map_of_contributing_names_the_code():
    """Every ``fedring.`` name in docs/contributing.md's "A round" section imports (a module, or a
    class, function or method in one), so the map cannot outlive a rename; and the round's
    function calls each stage the table names for it."""
    import importlib
    import inspect

    from fedring.train import loop

    page = (ROOT / "docs" / "contributing.md").read_text()
    section = page.split("## A round", 1)[1].split("\n## ", 1)[0]
    cited = sorted(set(re.findall(r"`(fedring(?:\.\w+)+)`", section)))
    assert len(cited) >= 15

    def resolves(dotted: str) -> bool:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
        return False

    assert [name for name in cited if not resolves(name)] == []
    body = inspect.getsource(loop.train_round)
    stages = [
        "participation.draw",
        "clients.updates",
        "privacy.release",
        "reference()",
        "adversary.attack",
        "topology.aggregate",
        "privacy.noised",
        "replica.apply",
    ]
    assert [stage for stage in stages if stage not in body] == []
