"""The helper of ``benchmarks/gpu.sh``: stand-in data sets, the test record and the summary.

``python benchmarks/gpu_figures.py data DIR``
    writes Fashion-MNIST (IDX) and CIFAR-10 ("python version" batches) files of random images in
    their published formats under DIR, for a machine that has neither data set: a training
    round's cost does not depend on the pixels. Prints the two folders' environment settings.
``python benchmarks/gpu_figures.py tests JUNIT.xml OUT.json DEVICE``
    the pytest run's counts and failures as a JSON record naming the device.
``python benchmarks/gpu_figures.py mark OUT.json KEY=VALUE ...``
    adds fields (the data's provenance, the step's command) to a figure's JSON record.
``python benchmarks/gpu_figures.py summary DIR``
    prints the figures of DIR's records: each training comparison's ratios, the server rounds
    against the ring-mean round, and ByzFL against fedring.
"""

from __future__ import annotations

import gzip
import json
import math
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

from fedring.datasets.cifar10 import TEST_FILE, TRAIN_FILES, write_batch
from fedring.datasets.fashion_mnist import FILES

#: samples of the stand-in sets: 100 clients get 60 Fashion-MNIST or 50 CIFAR-10 images each
FASHION_TRAIN, CIFAR_PER_BATCH, TEST = 6000, 1000, 1000


def write_idx(path: Path, array: np.ndarray) -> None:
    """An IDX file of unsigned bytes (magic 0x0000080N, then the sizes big-endian), gzipped (``path`` ends in .gz)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(header + array.astype(np.uint8).tobytes())


def data(root: Path) -> None:
    rng = np.random.default_rng(0)
    fashion, cifar = root / "fashion-mnist", root / "cifar-10-batches-py"
    fashion.mkdir(parents=True, exist_ok=True)
    cifar.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", FASHION_TRAIN), ("test", TEST)):
        write_idx(fashion / FILES[f"{split}_images"], rng.integers(0, 256, (n, 28, 28)))
        write_idx(fashion / FILES[f"{split}_labels"], rng.integers(0, 10, n))
    for name in (*TRAIN_FILES, TEST_FILE):
        write_batch(
            cifar / name, rng.integers(0, 256, (CIFAR_PER_BATCH, 3, 32, 32)), rng.integers(0, 10, CIFAR_PER_BATCH)
        )
    print(f"FEDRING_DATA={fashion} FEDRING_CIFAR10={cifar}")


def tests(junit: Path, out: Path, device: str) -> None:
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None, f"{junit}: no testsuite"
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    record = {
        "device": device,
        **counts,
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
    }
    record["failed"] = failed
    record["seconds"] = float(suite.get("time", 0.0))
    out.write_text(json.dumps(record, indent=1) + "\n")


def mark(path: Path, pairs: list[str]) -> None:
    record = json.loads(path.read_text())
    for pair in pairs:
        key, _, value = pair.partition("=")
        record[key] = value
    path.write_text(json.dumps(record, indent=1) + "\n")


def summary(root: Path) -> None:
    records = {p.stem: json.loads(p.read_text()) for p in sorted(root.glob("*.json"))}
    tests_record = records.pop("tests", None)
    if tests_record is not None:
        print(
            f"tests on {tests_record['device']}: {tests_record['passed']} passed, {tests_record['skipped']} skipped, "
            f"{tests_record['failures'] + tests_record['errors']} failed {tests_record['failed'] or ''}"
        )
    local = records.pop("local_ring", None)
    if local is not None:
        for r in local["records"]:
            print(
                f"ring of {r['clients']} on one rank, d={r['d']}, {r['rows']} on {r['device']}: "
                f"{r['ring_s'] * 1e3:.3f} ms, ring/bare sum {r['ratio']:.2f}"
            )
    draws = records.pop("draws", None)
    if draws is not None:
        us = draws["us_per_client"]
        print(
            f"draws per client, µs: generator {us['generator']:.2f}, client_generators {us['client_generators']:.2f}, "
            f"whole draw {us['client_generators, choice and sort']:.2f}; together faster from "
            f"{draws.get('together_from')} clients"
        )
    rings = {r["model"]: r for name, r in records.items() if name.startswith("train-") and name.endswith("-ring")}
    for name, r in records.items():
        if not name.startswith("train-"):
            continue
        s = r["seconds_per_round"]
        line = f"{name:<34} {r['device_name']:<24} fedring/bare {r['ratio']:.2f}"
        if "ratio_batched" in r:
            line += f"  batched({r['batched_clients']})/bare-batched {r['ratio_batched']:.2f}"
            line += f"  batched speed-up {r['speedup_batched']:.2f}"
        ring = rings.get(r["model"])
        if ring is not None and ring is not r:
            line += f"  round / ring-mean round {s['fedring'] / ring['seconds_per_round']['fedring']:.2f}"
            if "fedring-batched" in s and "fedring-batched" in ring["seconds_per_round"]:
                line += f" (batched {s['fedring-batched'] / ring['seconds_per_round']['fedring-batched']:.2f})"
        print(line)
    bench = records.get("aggregators")
    if bench is None:
        return
    rows = bench["records"]
    device = bench["meta"].get("device_name", "?")
    if not rows:
        print(f"bench aggregators on {device}: no rule timed")
        return
    print(f"bench aggregators on {device}: {len(rows)} rules timed, n={rows[0]['clients']} d={rows[0]['dim']}")
    for r in rows:
        other = r.get("byzfl_skipped") or ""
        if r.get("byzfl"):
            other = f"ByzFL {r['byzfl_seconds']:.4f} s ({r['byzfl_over_fedring']:.2f}x)"
        print(f"  {r['rule']:<17} {r['seconds']:.4f} s  {other}")
    ratios = [r["byzfl_over_fedring"] for r in rows if r.get("byzfl")]
    if ratios:
        mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"  ByzFL / fedring, geometric mean over {len(ratios)} rules: {mean:.2f}")


def main(argv: list[str]) -> int:
    command, *rest = argv
    if command == "data":
        data(Path(rest[0]))
    elif command == "tests":
        tests(Path(rest[0]), Path(rest[1]), rest[2])
    elif command == "mark":
        mark(Path(rest[0]), rest[1:])
    elif command == "summary":
        summary(Path(rest[0]))
    else:
        raise SystemExit(f"unknown command {command!r}: data, tests, mark or summary")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
