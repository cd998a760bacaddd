"""Hostile input: a setting that cannot work is refused before any work, as one line (exit 2).

Each numeric setting gets its extremes (0, negative, nan, inf, 10^12, beyond 2^63, a wrong type,
empty), and settings files every malformation (not UTF-8, a byte-order mark, over 1 MiB, nested
past the parser's depth, a directory ...). The checks call the command line's own parse and
validate step in-process (:func:`fedring.cli.run.build_config`, with a given world size), so
hundreds of cases take a second; two real runs on 2 ranks check that the same refusal ends
every rank with exit code 2, one line on stderr, no traceback and no file.

A value that is accepted must be legitimate: ``LEGITIMATE`` lists those, each a working run
(``docs/cli.md``): a very long run (``rounds = 10^12``: results stream to the file, memory does
not grow with the rounds), a batch larger than a client's data (the whole shard), a huge
learning rate (the run diverges; non-finite updates are handled), ``stop_grace`` longer than
any job (a second signal still aborts at once).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import MPIEXEC, mpi_env

from fedring.cli.run import build_config
from fedring.config import MAX_CONFIG_BYTES
from fedring.errors import ConfigError

BASE = ["--dataset", "synthetic", "--clients", "8", "--byzantine", "2", "--attack", "gaussian"]
NUMERIC = [
    "clients",
    "byzantine",
    "declared_f",
    "server_samples",
    "noniid",
    "rounds",
    "lr",
    "batch_size",
    "local_steps",
    "seed",
    "eval_every",
    "threads",
    "checkpoint_every",
    "stop_grace",
]
#: as --set VALUE (TOML literals, and a bare word read as a string)
EXTREMES = [
    "0",
    "-1",
    "-0.5",
    "nan",
    "inf",
    "-inf",
    "1e12",
    "1000000000000",
    "1e400",
    "1" + "0" * 40,
    "true",
    '"x"',
    "x",
    '""',
    "[]",
    "[1, 2]",
    "{}",
    "{a = 1}",
]
BIG = {"1e12", "1000000000000"}
#: accepted values: each a documented, working run (module docstring)
LEGITIMATE = {
    "byzantine": {"0"},  # no Byzantine clients (tested without an attack, which needs them)
    "declared_f": {"0"},
    "noniid": {"0"},  # Fang's q = 0: every sample goes to another label's group
    "seed": {"0"} | BIG,
    "lr": BIG | {"1" + "0" * 40},
    "stop_grace": BIG | {"1" + "0" * 40},
    **{key: BIG for key in ("rounds", "batch_size", "local_steps", "eval_every", "checkpoint_every", "server_samples")},
}


def outcome(argv: list[str], world_size: int = 2) -> str | None:
    """None if the settings are accepted, else the error's one line."""
    try:
        build_config(argv, world_size)
    except ConfigError as e:
        return str(e)
    return None


def assert_one_line(error: str | None, key: str) -> None:
    assert error is not None and "\n" not in error and len(error) < 400, error
    assert error.split(":")[0] in (key, "arguments", "byzantine"), error


@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_setting_at_its_extremes(tmp_path, key):
    out = tmp_path / "run.h5"
    # the settings as --set, so that the value tried, set last, wins (a named option would win over it)
    base = ["--dataset", "synthetic", "--out", str(out), "--set", "clients=8"]
    if key != "byzantine":
        base += ["--set", "byzantine=2", "--set", "attack=gaussian"]
    for value in EXTREMES:
        error = outcome([*base, "--set", f"{key}={value}"])
        if value in LEGITIMATE.get(key, ()):
            assert error is None, (key, value, error)
        else:
            assert_one_line(error, key)
        assert not out.exists()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--clients", "1000000000"),
        ("--clients", "-3"),
        ("--rounds", "nan"),
        ("--rounds", "1e12"),
        ("--lr", "inf"),
        ("--lr", ""),
        ("--batch-size", ""),
        ("--byzantine", "-1"),
        ("--noniid", "1.5"),
        ("--eval-every", "0"),
        ("--declared-f", "8"),
        ("--seed", "-1"),
        ("--checkpoint-every", "x"),
    ],
)
def test_named_options_at_their_extremes(tmp_path, option, value):
    assert_one_line(outcome([*BASE, "--out", str(tmp_path / "run.h5"), option, value]), option[2:].replace("-", "_"))


def test_more_clients_than_training_samples_is_refused_at_once():
    assert outcome(["--dataset", "synthetic", "--clients", "1000000000"]) == (
        "clients: 1000000000 clients but synthetic has 4,000 training samples: every client needs at least one"
    )
    assert outcome(["--clients", "60001"]).startswith("clients: 60001 clients but fashion-mnist has 60,000 ")
    assert outcome(["--dataset", "synthetic", "--clients", "4000", "--partition", "iid", "--out", "x.h5"], 4) is None


def test_integers_beyond_64_bits_and_long_values_are_cut_in_the_message():
    error = outcome(["--dataset", "synthetic", "--set", "seed=" + "9" * 70])
    assert error.startswith("seed: must be below 2^63, got 9999") and error.endswith("...") and len(error) < 120
    error = outcome(["--dataset", "synthetic", "--set", "seed=" + "9" * 5000])  # past Python's int parsing: a string
    assert error.startswith("seed: must be an integer, got '9999") and error.endswith("...") and len(error) < 120
    error = outcome(["--dataset", "synthetic", "--set", "rounds=" + "[" * 100_000])
    assert error.startswith("rounds: must be an integer, got '[[[[") and len(error) < 120


def write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_settings_files_of_every_malformation(tmp_path):
    def refused(data: bytes | None, expected: str) -> None:
        path = str(tmp_path) if data is None else write(tmp_path / "bad.toml", data)
        error = outcome(["--config", path, "--dataset", "synthetic", "--out", str(tmp_path / "run.h5")])
        assert error is not None and "\n" not in error and error.startswith("config: ") and expected in error, error
        assert not (tmp_path / "run.h5").exists()

    refused(b"rounds = 3  # caf\xe9\n", "is not UTF-8 text (byte 17): save it as UTF-8")
    refused(bytes(range(256)) * 8, "is not UTF-8 text")
    refused(b"rounds = 3\n" + b"# padding\n" * (MAX_CONFIG_BYTES // 10), "is larger than 1 MiB: not a settings file")
    refused(b"a = " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "nests its values too deeply to be a settings file")
    refused(b"rounds = 3\x00\n", "is not valid TOML")
    refused(b"rounds = \n", "is not valid TOML")
    refused(b"seed = " + b"9" * 5000 + b"\n", "is not valid TOML: Exceeds the limit (4300 digits)")
    refused(None, "cannot read")  # a directory
    error = outcome(["--config", str(tmp_path / "missing.toml")])
    assert error == f"config: file {tmp_path / 'missing.toml'} does not exist"
    # a deep table by dotted keys parses (no recursion) and is an unknown section
    deep = write(tmp_path / "deep.toml", b"a" + b".a" * 1000 + b" = 1\n")
    assert outcome(["--config", deep, "--dataset", "synthetic"]).startswith("a: unknown settings section")
    # a table where a setting takes a value: a section of that name, which no component has
    table = write(tmp_path / "t.toml", b"rounds = {a = 1}\n")
    assert outcome(["--config", table, "--dataset", "synthetic"]).startswith("rounds: unknown settings section")


def test_a_byte_order_mark_and_an_empty_file_are_read_as_usual(tmp_path):
    bom = write(tmp_path / "bom.toml", b"\xef\xbb\xbfrounds = 3\n")
    assert build_config(["--config", bom, "--dataset", "synthetic"], 2).rounds == 3
    empty = write(tmp_path / "empty.toml", b"")
    assert build_config(["--config", empty, "--dataset", "synthetic"], 2).rounds == 100


def test_a_top_level_key_after_a_section_gets_a_hint(tmp_path):
    path = write(tmp_path / "s.toml", b'seed = 1\n[krum]\nvariant = "paper"\nrounds = 3\n')
    with pytest.raises(ConfigError) as e:  # validation builds the rule, the instance the run uses
        build_config(["--config", path, "--dataset", "synthetic", "--topology", "server", "--aggregator", "krum"], 2)
    assert str(e.value) == (
        "krum.rounds: unknown parameter of aggregator krum; rounds is a top-level setting: in a TOML "
        "file, put it above the first [section] (TOML reads every key after [krum] into that "
        "section); allowed: variant"
    )


def test_a_misspelt_option_gets_a_suggestion():
    assert outcome(["--agregator", "krum"]) == (
        "arguments: unknown option --agregator; did you mean --aggregator? (see python -m fedring run --help)"
    )
    assert outcome(["--eval-evry=5"]).startswith("arguments: unknown option --eval-evry; did you mean --eval-every?")
    assert (
        outcome(["--xyzzy", "3"]) == "arguments: unrecognized arguments: --xyzzy 3 (see python -m fedring run --help)"
    )


@pytest.mark.mpi
@pytest.mark.parametrize(
    "args",
    [
        ["--dataset", "synthetic", "--clients", "1000000000"],
        ["--config", "BAD"],
    ],
)
def test_refused_on_every_rank_in_one_line(tmp_path, args):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    bad = write(tmp_path / "bad.toml", b"\xff\xfe rounds = 3\n")
    out = tmp_path / "run.h5"
    cmd = [
        MPIEXEC,
        "-n",
        "2",
        sys.executable,
        "-m",
        "fedring",
        "run",
        *[bad if a == "BAD" else a for a in args],
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=mpi_env(), cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("fedring: error: ")
    assert "Traceback" not in proc.stderr and not list(tmp_path.glob("run.h5*"))
