"""A cluster of "machines" on this one: N network namespaces on a bridge.

Each node is a network namespace with

- one interface, ``eth0``, the node's end of a veth pair whose other end is a port of a
  bridge; the bridge lives in a namespace of its own (the "switch"), so nothing is added to
  this machine's own network stack and deleting the namespaces deletes every link;
- an address in a private /24 chosen at random (10.200-249.x.0/24), which exists only
  inside these namespaces: traffic to it never leaves them;
- a hostname (``node0``, ``node1``, ...), given to every process started on the node by a
  UTS namespace of its own (``unshare --uts``);
- its own /etc/hosts, at /etc/netns/NAME/hosts, which ``ip netns exec`` mounts over
  /etc/hosts for the node's processes. With ``hostname_resolves_to="address"`` a node's
  own name resolves to its address; with ``"loopback"`` it resolves to 127.0.1.1, as in
  Debian's and Ubuntu's default /etc/hosts (the other nodes' names still resolve to their
  addresses, as DNS would give them);
- optionally a shaped link: a tbf qdisc on the node's end of its veth, so that each node
  sends at most `rate` (its own full-duplex link, unlike a shaped loopback shared by both
  directions).

`Cluster.cut(node)` takes a node's link down (its switch port: the node sees no carrier,
as with a pulled cable) and `Cluster.restore(node)` brings it back.

The namespaces share this machine's file system, as a cluster's nodes share their storage.
Everything the cluster creates (namespaces, /etc/netns entries, processes) is removed when
it is closed; `Cluster.leftovers` says what would remain. Where namespaces cannot be made
(not root, no ``ip``/``unshare``) `cluster` skips the test with the reason.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

NETNS_DIR = "/etc/netns"


def _run(*command, check=True, timeout=30):
    result = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")
    return result


_RATE_UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}


def _burst_bytes(rate: str) -> int:
    """tbf's bucket for `rate` ("2gbit", "500mbit"): 10 ms at that rate, at least 512 KiB.
    A bucket smaller than what the rate sends between two timer ticks caps the link below
    its rate (512 KiB holds only 2 ms at 2 Gbit/s, 0.4 ms at 10 Gbit/s)."""
    for unit, scale in _RATE_UNITS.items():
        if rate.lower().endswith(unit):
            bits_per_second = float(rate[:-len(unit)]) * scale
            return max(512 * 1024, int(bits_per_second / 8 / 100))
    raise ValueError(f"a rate such as '2gbit' or '500mbit', got {rate!r}")


def why_not_possible() -> str | None:
    """The reason this machine cannot run the cluster, or None when it can."""
    if os.geteuid() != 0:
        return "the cluster of network namespaces needs root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"the cluster of network namespaces needs `{tool}` (iproute2, util-linux)"
    return None


class Node:
    """One machine of the cluster: `netns` (its namespace), `hostname`, `address`."""

    def __init__(self, index: int, netns: str, address: str, port: str) -> None:
        self.index = index
        self.netns = netns
        self.hostname = f"node{index}"
        self.address = address
        self.ifname = "eth0"          # inside the node's namespace
        self.switch_port = port       # inside the switch's namespace

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this node: in its namespace (its /etc/hosts mounted), under its
        hostname."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname, *argv]

    def run(self, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Runs `argv` on this node to completion (output captured as text)."""
        return subprocess.run(self.command(argv), capture_output=True, text=True,
                              timeout=timeout, **kwargs)

    def python(self, code: str, timeout: float = 60) -> str:
        """The standard output of ``python -c code`` run on this node (raises on failure)."""
        result = self.run([sys.executable, "-c", code], timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"on {self.hostname}: {result.stderr.strip()}")
        return result.stdout

    def pids(self) -> list[int]:
        """The processes running in this node's namespace."""
        out = _run("ip", "netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def __repr__(self) -> str:
        return f"Node({self.hostname}, {self.address})"


class Cluster:
    """N nodes on one bridge (see the module docstring). Use `cluster()` to make one."""

    def __init__(self, num_nodes: int, *, hostname_resolves_to: str = "address",
                 rate: str | None = None) -> None:
        if hostname_resolves_to not in ("address", "loopback"):
            raise ValueError("hostname_resolves_to is 'address' or 'loopback'")
        tag = f"{os.getpid() % 100000:05d}{random.randrange(1000):03d}"
        self.tag = tag
        self.switch = f"tsc{tag}sw"
        subnet = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
        self.nodes = [Node(i, f"tsc{tag}n{i}", f"{subnet}.{i + 1}", f"p{i}")
                      for i in range(num_nodes)]
        self.hostname_resolves_to = hostname_resolves_to
        self.rate = rate
        self._created: list[str] = []

    # -- set-up and tear-down ---------------------------------------------------------
    def start(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self._created.append(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            _run("ip", "netns", "add", node.netns)
            self._created.append(node.netns)
            _run("ip", "link", "add", node.ifname, "netns", node.netns, "type", "veth",
                 "peer", "name", node.switch_port, "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", node.switch_port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", node.switch_port, "up")
            _run("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev",
                 node.ifname)
            _run("ip", "-n", node.netns, "link", "set", node.ifname, "up")
            _run("ip", "-n", node.netns, "link", "set", "lo", "up")
            if self.rate is not None:
                self.shape(node, self.rate)
            os.makedirs(os.path.join(NETNS_DIR, node.netns), exist_ok=True)
            with open(os.path.join(NETNS_DIR, node.netns, "hosts"), "w") as f:
                f.write(self.hosts_file(node))

    def hosts_file(self, node: Node) -> str:
        """The /etc/hosts `node` sees."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        for other in self.nodes:
            if other is node and self.hostname_resolves_to == "loopback":
                lines.append(f"127.0.1.1\t{other.hostname}")   # Debian's default
            else:
                lines.append(f"{other.address}\t{other.hostname}")
        return "\n".join(lines) + "\n"

    def shape(self, node: Node, rate: str) -> None:
        """Limits what `node` sends to `rate` (tc tbf on its end of the veth)."""
        _run("tc", "-n", node.netns, "qdisc", "replace", "dev", node.ifname, "root", "tbf",
             "rate", rate, "burst", f"{_burst_bytes(rate)}b", "latency", "50ms")

    def cut(self, node: Node) -> None:
        """Takes `node`'s link down (its switch port): its packets go nowhere."""
        _run("ip", "-n", self.switch, "link", "set", node.switch_port, "down")

    def restore(self, node: Node) -> None:
        """Brings `node`'s link back up."""
        _run("ip", "-n", self.switch, "link", "set", node.switch_port, "up")

    def kill_processes(self) -> None:
        """SIGKILLs every process still running on a node (a test's leftovers)."""
        for node in self.nodes:
            for pid in node.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(node.pids() for node in self.nodes) and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        """Removes everything the cluster made: processes, namespaces (with their links and
        the bridge), /etc/netns entries."""
        if any(name == node.netns for node in self.nodes for name in self._created):
            self.kill_processes()
        for name in reversed(self._created):
            _run("ip", "netns", "del", name, check=False)
        self._created.clear()
        for node in self.nodes:
            shutil.rmtree(os.path.join(NETNS_DIR, node.netns), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(NETNS_DIR)   # only when empty: other users' entries stay

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (empty after `close`)."""
        names = set(_run("ip", "netns", "list", check=False).stdout.split())
        out = [f"namespace {n}" for n in [self.switch] + [x.netns for x in self.nodes]
               if n in names]
        out += [f"{NETNS_DIR}/{x.netns}" for x in self.nodes
                if os.path.exists(os.path.join(NETNS_DIR, x.netns))]
        return out


@contextlib.contextmanager
def cluster(num_nodes: int = 2, **options):
    """A started `Cluster` of `num_nodes` nodes, closed on exit. Skips the calling test,
    with the reason, where this machine cannot make one."""
    reason = why_not_possible()
    if reason is not None:
        pytest.skip(reason)
    nodes = Cluster(num_nodes, **options)
    try:
        try:
            nodes.start()
            # Entering a namespace can still be forbidden (some containers).
            nodes.nodes[0].python("")
        except (RuntimeError, subprocess.SubprocessError) as error:
            pytest.skip(f"cannot make a cluster of network namespaces here: {error}")
        yield nodes
    finally:
        nodes.close()
