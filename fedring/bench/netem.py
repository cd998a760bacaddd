"""An emulated cluster on one machine, for ``python -m fedring bench network``.

Each node is a Linux network namespace (with its own host name) holding one end of a veth
pair whose other end sits on a bridge in a "head" namespace; both directions of every node's
link are shaped by a token bucket (``tc tbf``) to the chosen rate, so every byte between nodes
crosses a link of that bandwidth while ranks on one node still talk through shared memory.
One MPICH job spans the nodes: hydra's ssh launcher is replaced by a script that enters the
node's namespaces (``nsenter``), and the head runs ``mpiexec``.

Safety: everything lives in namespaces created here. :func:`run` re-executes this module in
a private network, mount and UTS namespace (the head, :func:`_head`): the bridge, its address,
the host name ``head`` and the private ``/etc/hosts`` (a bind mount seen only there) exist in
that namespace alone, and the nodes' namespaces are held by processes that die with the head
(``PR_SET_PDEATHSIG``). When the head exits, normally, on an exception, on Ctrl-C or killed,
the kernel removes the namespaces and everything in them; the only file outside, the launcher
script's folder under the temporary directory, is removed on exit, and a crashed run's folder
is removed by the next run. The machine's own network, ``/etc/hosts`` and host name are never
touched, and the head refuses to build anything unless it runs in namespaces other than its
parent's.

Link settings (:data:`LINK`) come from measuring this setup: jumbo frames (MTU 9000; at 1500
the frames' headers cost about 4.5 %), socket buffers of up to 64 MiB per node (a namespace
starts with small maxima, and a sender that loses its core then stalls its link), a bucket of
at least 256 KiB and 1 ms of the rate, 100 ms of queue.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import TypedDict

from fedring.errors import ConfigError

SUBNET = "10.77.0"  # node i is SUBNET.i, the head SUBNET.254 (private addresses, inside our namespaces only)
HEAD_ADDRESS = f"{SUBNET}.254"


class Link(TypedDict):
    """What every emulated link is built with."""

    mtu: int
    tcp_buffer: int
    burst_bytes: int
    burst_seconds: float
    queue: str


LINK: Link = {"mtu": 9000, "tcp_buffer": 64 << 20, "burst_bytes": 256 << 10, "burst_seconds": 1e-3, "queue": "100ms"}
TOOLS = ("ip", "tc", "unshare", "nsenter")
TMP_PREFIX = "fedring-netem-"
UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(text: str) -> int:
    """A link rate as ``tc`` writes it (SI units, bits per second) -> bits per second.

    >>> parse_rate("100mbit"), parse_rate("1gbit"), parse_rate("2.5gbit"), parse_rate("800000")
    (100000000, 1000000000, 2500000000, 800000)
    """
    t = str(text).strip().lower()
    unit = next((u for u in sorted(UNITS, key=len, reverse=True) if t.endswith(u)), "")
    try:
        bps = float(t[: len(t) - len(unit)]) * UNITS.get(unit, 1)
    except ValueError:
        bps = 0.0
    if not 1e5 <= bps <= 1e12:
        raise ConfigError("rate", f"{text!r} is not a link rate from 100kbit to 1tbit (e.g. 100mbit, 1gbit, 10gbit)")
    return int(bps)


def missing() -> list[str]:
    """What this machine lacks to build the cluster: root, the tools, mpiexec (empty: nothing)."""
    lacks = [] if os.geteuid() == 0 else ["root"]
    lacks += [tool for tool in TOOLS if shutil.which(tool) is None]
    if mpiexec() is None:
        lacks.append("mpiexec")
    return lacks


def mpiexec() -> str | None:
    """The ``mpiexec`` beside this Python (a venv's ``mpich`` wheel), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def _die_with_parent(sig: int = signal.SIGKILL):
    """A ``preexec_fn``: the child gets ``sig`` when the process that started it dies."""

    def setup():
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG (survives exec)

    return setup


def _remove_stale_folders() -> None:
    """Remove launcher folders left by a crashed run of this tool (their head process is gone)."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        if not name.startswith(TMP_PREFIX):
            continue
        pid = name[len(TMP_PREFIX) :].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


def run(nodes: int, rate_bps: int, ranks_per_node: int, program: list[str], timeout: float) -> int:
    """Build a cluster of ``nodes`` nodes with links of ``rate_bps``, run ``program`` (argv after
    ``python``) as one MPI job of ``nodes * ranks_per_node`` ranks across it, tear it down.

    Returns the job's exit status (124 when it ran past ``timeout`` seconds and was killed).
    """
    spec = {
        "nodes": nodes,
        "rate_bps": rate_bps,
        "ppn": ranks_per_node,
        "program": program,
        "timeout": timeout,
        "parent_ns": {kind: os.readlink(f"/proc/self/ns/{kind}") for kind in ("net", "mnt", "uts")},
    }
    cmd = [
        "unshare",
        "--net",
        "--mount",
        "--uts",
        "--propagation",
        "private",
        sys.executable,
        "-m",
        "fedring.bench.netem",
        json.dumps(spec),
    ]
    head = subprocess.Popen(cmd, preexec_fn=_die_with_parent(signal.SIGTERM))
    try:
        return head.wait()
    except KeyboardInterrupt:
        head.terminate()  # the head tears the cluster down on SIGTERM
        head.wait(timeout=30)
        raise
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()


def _sh(*args: str, ns_pid: int | None = None) -> None:
    """Run a command, in the network namespace of process ``ns_pid`` if given; raise on failure."""
    cmd = list(args) if ns_pid is None else ["nsenter", f"--net=/proc/{ns_pid}/ns/net", *args]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")


def _launcher(folder: str, holders: dict[str, int]) -> str:
    """hydra's ssh replacement: ``launcher [-x ...] HOST CMD`` runs the shell command CMD in node HOST."""
    cases = "\n".join(f"  {host}) pid={pid} ;;" for host, pid in holders.items())
    path = os.path.join(folder, "launch")
    with open(path, "w") as f:
        f.write(f"""#!/bin/sh
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}
  *) echo "fedring netem launcher: unknown node $host" >&2; exit 1 ;;
esac
exec nsenter --net=/proc/$pid/ns/net --uts=/proc/$pid/ns/uts /bin/sh -c "$*"
""")
    os.chmod(path, 0o700)
    return path


def _node(i: int, rate: str, burst: int) -> int:
    """Start node ``i``: a process holding a new network and UTS namespace; returns its pid."""
    holder = subprocess.Popen(
        ["unshare", "--net", "--uts", "/bin/sh", "-c", f"hostname node{i} && exec sleep infinity"],
        preexec_fn=_die_with_parent(),
        stdin=subprocess.DEVNULL,
    )
    for _ in range(500):  # until the shell has set the host name and become `sleep` (bounded: 5 s)
        try:
            with open(f"/proc/{holder.pid}/comm") as f:
                if f.read().strip() == "sleep":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.01)
    if holder.poll() is not None:
        raise RuntimeError(f"node{i}: could not create its namespaces (exit {holder.returncode})")
    pid = holder.pid
    mtu, buf, queue = str(LINK["mtu"]), LINK["tcp_buffer"], LINK["queue"]
    _sh("ip", "link", "add", f"v{i}", "mtu", mtu, "type", "veth", "peer", "name", "eth0", "mtu", mtu, "netns", str(pid))
    _sh("ip", "link", "set", f"v{i}", "master", "br0", "up")
    for args in (
        ("ip", "link", "set", "lo", "up"),
        ("ip", "addr", "add", f"{SUBNET}.{i}/24", "dev", "eth0"),
        ("sysctl", "-q", "-w", f"net.ipv4.tcp_rmem=4096 131072 {buf}", f"net.ipv4.tcp_wmem=4096 16384 {buf}"),
        ("ip", "link", "set", "eth0", "up"),
        ("tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", str(burst), "latency", queue),
    ):  # the node's upload
        _sh(*args, ns_pid=pid)
    _sh("tc", "qdisc", "add", "dev", f"v{i}", "root", "tbf", "rate", rate, "burst", str(burst), "latency", queue)
    return pid  # ... and its download: the bridge port's egress towards it


def _head(spec: dict) -> int:
    """Inside the private namespaces made by :func:`run`: build the cluster, run the job, clean up."""
    for kind, parent in spec["parent_ns"].items():
        if os.readlink(f"/proc/self/ns/{kind}") == parent:
            print(f"fedring netem: not in a private {kind} namespace, refusing to build anything", file=sys.stderr)
            return 1
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    nodes, rate_bps = spec["nodes"], spec["rate_bps"]
    rate, burst = f"{rate_bps}bit", max(LINK["burst_bytes"], int(rate_bps / 8 * LINK["burst_seconds"]))
    _remove_stale_folders()
    folder = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-")
    holders: dict[str, int] = {}
    job = None
    try:
        hosts = os.path.join(folder, "hosts")
        with open(hosts, "w") as f:
            f.write(f"127.0.0.1 localhost\n{HEAD_ADDRESS} head\n")
            f.writelines(f"{SUBNET}.{i} node{i}\n" for i in range(1, nodes + 1))
        _sh("mount", "--bind", hosts, "/etc/hosts")  # private mount namespace: seen here only
        _sh("hostname", "head")  # private UTS namespace: hydra's proxies connect back to it
        _sh("ip", "link", "set", "lo", "up")
        _sh("ip", "link", "add", "br0", "mtu", str(LINK["mtu"]), "type", "bridge")
        _sh("ip", "addr", "add", f"{HEAD_ADDRESS}/24", "dev", "br0")
        _sh("ip", "link", "set", "br0", "up")
        for i in range(1, nodes + 1):
            holders[f"node{i}"] = _node(i, rate, burst)
        cmd = [
            mpiexec(),
            "-hosts",
            ",".join(holders),
            "-n",
            str(nodes * spec["ppn"]),
            "-ppn",
            str(spec["ppn"]),
            "-launcher",
            "ssh",
            "-launcher-exec",
            _launcher(folder, holders),
            "-genv",
            "MPIR_CVAR_CH4_NETMOD",
            "ofi",
            "-genv",
            "FI_PROVIDER",
            "tcp",
            "-genv",
            "OMP_NUM_THREADS",
            "1",
            "-genv",
            "OPENBLAS_NUM_THREADS",
            "1",
            sys.executable,
            *spec["program"],
        ]
        job = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL)
        try:
            return job.wait(timeout=spec["timeout"])
        except subprocess.TimeoutExpired:
            print(f"fedring netem: the MPI job ran past {spec['timeout']:.0f} s: killed", file=sys.stderr)
            return 124
    finally:
        if job is not None and job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        for pid in holders.values():
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        shutil.rmtree(folder, ignore_errors=True)


def link_counters(device: str = "eth0") -> tuple[int, int]:
    """(bytes sent, bytes received) by ``device`` of the calling process's network namespace.

    Read from ``/proc/net/dev``, which is per namespace (``/sys/class/net`` shows the machine's).
    """
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == device:
                v = fields.split()
                return int(v[8]), int(v[0])
    raise RuntimeError(f"no network device {device} in this namespace")


def tcp_retransmits() -> int:
    """TCP segments the calling process's network namespace has sent again (``RetransSegs`` of
    ``/proc/net/snmp``, per namespace): each one crosses the link twice, which the link's byte
    counters include and the ledger's payload does not."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


if __name__ == "__main__":
    sys.exit(_head(json.loads(sys.argv[1])))
