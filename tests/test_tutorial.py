"""docs/tutorial.md, run as written: its files and commands are read from the page, in order."""

import json
import re
import subprocess

import h5py
import pytest
from conftest import MPIEXEC, ROOT, mpi_env, wait_for

from fedring.results import FileStatus
from fedring.sweep import file_state

#: a fenced block: its language, then ``file=NAME`` (a file to write) or ``slurm`` (needs sbatch)
BLOCK = re.compile(r"^```(\w+)(?: (file=\S+|slurm))?\n(.*?)^```$", re.S | re.M)


def tutorial_steps() -> list[tuple[str, str, str]]:
    """(kind, name, text): ``("file", "mylab.py", source)`` or ``("bash", "" or "slurm", commands)``."""
    steps = []
    for lang, tag, body in BLOCK.findall((ROOT / "docs" / "tutorial.md").read_text()):
        if tag.startswith("file="):
            steps.append(("file", tag[len("file=") :], body))
        elif lang == "bash":
            steps.append(("bash", tag, body))
    return steps


def test_the_page_has_the_steps_the_issue_asks_for():
    steps = tutorial_steps()
    assert [name for kind, name, _ in steps if kind == "file"] == ["make_data.py", "mylab.py", "grid.toml"]
    commands = "\n".join(text for kind, _, text in steps if kind == "bash")
    for needle in (
        "mpiexec -n 2 python -m fedring run --plugin mylab",
        "sweep grid.toml --local",
        "sweep grid.toml --submit",
        "kill -TERM",
        "--resume",
        "python -m analysis table",
    ):
        assert needle in commands


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")
def test_tutorial_runs_as_written(tmp_path, slurm_cluster):
    has_slurm = slurm_cluster is None  # a cluster that takes jobs, not merely sbatch on the path
    printed = ""
    for kind, name, text in tutorial_steps():
        if kind == "file":
            (tmp_path / name).write_text(text)
            continue
        if name == "slurm" and not has_slurm:
            continue
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", text],
            cwd=tmp_path,
            env=mpi_env(),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0, f"{text}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        printed += proc.stdout
    assert quoted_table() in printed  # the page's table is the one its grid gives
    with h5py.File(tmp_path / "results/long.h5") as f:  # interrupted, then resumed without --plugin
        assert f.attrs["status"] == "complete" and json.loads(f.attrs["config"])["plugins"] == ["mylab"]
        assert f["metrics/round"][-1] == 120
    grid = sorted((tmp_path / "results/grid").glob("*.h5"))
    assert len(grid) == 3
    if has_slurm:  # the array job, submitted before the steps above, has run alongside them
        grid += wait_for_array(tmp_path / "results/grid-slurm", 3)
    for path in grid:
        with h5py.File(path) as f:
            cfg = json.loads(f.attrs["config"])
            assert f.attrs["status"] == "complete" and cfg["plugins"] == ["mylab"] and cfg["model"] == "tinynet"
    assert (tmp_path / "runs.csv").read_text().count("\n") > 3


def quoted_table() -> str:
    """The analysis table the page quotes (its one ``text`` block)."""
    (table,) = [body for lang, _, body in BLOCK.findall((ROOT / "docs" / "tutorial.md").read_text()) if lang == "text"]
    return table


def wait_for_array(out_dir, tasks: int, timeout: float = 300) -> list:
    """The results files of a sweep's array job, once all ``tasks`` are complete."""

    def complete():
        files = sorted(out_dir.glob("*.h5"))
        done = len(files) == tasks and all(file_state(f).kind == FileStatus.COMPLETE for f in files)
        return files if done else None

    return wait_for(f"the array job's {tasks} runs in {out_dir}", complete, timeout)
