"""Which network interface this machine's replicas talk on, chosen when the user did not.

gloo (and NCCL's bootstrap) advertise to the other machines the address their device is
bound to. Without ``GLOO_SOCKET_IFNAME`` gloo binds to the address this machine's hostname
resolves to. Debian's and Ubuntu's default /etc/hosts resolve the hostname to 127.0.1.1,
and hosts with containers or several networks resolve it to an address of another
network: the other machines then connect to an address they cannot reach, and every worker
fails with gloo's "connectFullMesh failed ... Connection refused".

`configure` picks instead the interface whose address the kernel uses to reach the chief
(MASTER_ADDR / the first TF_CONFIG task): a UDP socket "connected" to the chief (which
sends nothing) reports that source address, and the interface holding it is the one the
chief and its peers can reach. On the chief's own machine, where the chief's name may
itself resolve to loopback, it is the machine's single non-loopback interface, else the one
of its default route. The choice is set as ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` before the process group is created, and logged once at INFO. A
user's own ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (either) is always left alone.

`advertised_address` says what this replica tells its peers, for error messages.
"""
from __future__ import annotations

import dataclasses
import datetime
import fcntl
import ipaddress
import logging
import os
import re
import socket
import struct
import time
from typing import MutableMapping

import torch.distributed as dist

from torchstrategy.launch import rendezvous

logger = logging.getLogger("torchstrategy")

# The variables by which a user chooses the interface (torch's gloo, NCCL).
USER_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915


@dataclasses.dataclass(frozen=True)
class Choice:
    """An interface chosen for the replicas' traffic.

    Attributes:
      interface: its name (what GLOO_SOCKET_IFNAME takes).
      address: its address, which the other machines will connect to.
      reason: why the hostname's own address was not used (for the log and errors).
    """

    interface: str
    address: str
    reason: str


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8 and ::1 (and anything that is not an IP address: False)."""
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def resolve(host: str) -> str | None:
    """The first address `host` resolves to here (an IP stays itself), or None."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    return str(infos[0][4][0]) if infos else None


def source_address(address: str) -> str | None:
    """The local address the kernel would send from to reach `address` (a UDP "connect"
    chooses the route and sends nothing), or None when there is no route."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def interface_addresses() -> dict[str, list[str]]:
    """Every interface of this machine that has an address: name -> its addresses (the
    primary IPv4 address, then the IPv6 ones)."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address (or down without one)
                continue
            found.setdefault(name, []).append(socket.inet_ntoa(packed[20:24]))
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6:
                    raw = fields[0]
                    text = ":".join(raw[i:i + 4] for i in range(0, 32, 4))
                    found.setdefault(fields[5], []).append(
                        str(ipaddress.ip_address(text)))
    except OSError:  # no IPv6
        pass
    return found


def interface_of(address: str) -> str | None:
    """The name of the local interface holding `address`, or None."""
    for name, addresses in interface_addresses().items():
        if address in addresses:
            return name
    return None


def _interface_is_up(name: str) -> bool:
    try:
        with open(f"/sys/class/net/{name}/operstate") as f:
            return f.read().strip() in ("up", "unknown")
    except OSError:
        return True  # no sysfs: assume so


def _default_route_interface() -> str | None:
    """The interface of the IPv4 default route (/proc/net/route), or None."""
    try:
        with open("/proc/net/route") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) > 1 and fields[1] == "00000000":
                    return fields[0]
    except OSError:
        pass
    return None


def outward_interface() -> tuple[str, str] | None:
    """(interface, address) the other machines most likely reach this one at, when its own
    name resolves to loopback: its only non-loopback interface with an IPv4 address that is
    up, else the default route's; None when neither exists."""
    candidates = {name: [a for a in addresses if "." in a]
                  for name, addresses in interface_addresses().items()}
    candidates = {name: addresses for name, addresses in candidates.items()
                  if addresses and not is_loopback(addresses[0]) and _interface_is_up(name)}
    if len(candidates) == 1:
        name, addresses = next(iter(candidates.items()))
        return name, addresses[0]
    default = _default_route_interface()
    if default in candidates:
        return default, candidates[default][0]
    return None


def hostname_address() -> str | None:
    """The address gloo binds to by default: the first address of this machine's hostname
    (None when it does not resolve)."""
    return resolve(socket.gethostname())


def user_choice(environ: MutableMapping[str, str] | None = None) -> str | None:
    """The user's own interface choice ("GLOO_SOCKET_IFNAME=eth1"), or None."""
    env = os.environ if environ is None else environ
    for name in USER_VARIABLES:
        if env.get(name):
            return f"{name}={env[name]}"
    return None


def choose(chief: str) -> Choice | None:
    """The interface to use to reach the chief at host `chief`, or None when the hostname's
    own address (gloo's default) is already the one the kernel uses to reach the chief, or
    when no better one can be told.

    The hostname's address is replaced when it is loopback, does not resolve, or is not the
    address this machine reaches the chief from (an address on another network).
    """
    mine = hostname_address()
    target = resolve(chief)
    if target is None:
        return None
    if is_loopback(target):
        # A loopback address or "localhost" for the chief: every replica is on this one
        # machine. A name resolving to loopback: the chief's machine is this one, and only
        # its outward interface can be reached by the others.
        if chief == "localhost" or _is_ip(chief) or mine is not None and not is_loopback(mine):
            return None
        found = outward_interface()
        if found is None:
            return None
        return Choice(found[0], found[1],
                      f"this machine's hostname {socket.gethostname()!r} resolves to "
                      f"{mine or 'nothing'}, which the other machines cannot reach")
    source = source_address(target)
    if source is None or source == mine:
        return None
    interface = interface_of(source)
    if interface is None:
        return None
    if mine is None:
        reason = f"this machine's hostname {socket.gethostname()!r} does not resolve"
    elif is_loopback(mine):
        reason = (f"this machine's hostname {socket.gethostname()!r} resolves to {mine}, a "
                  "loopback address the other machines cannot reach")
    else:
        reason = (f"this machine's hostname {socket.gethostname()!r} resolves to {mine}, "
                  f"but the chief ({chief}) is reached from {source}")
    return Choice(interface, source, reason)


def configure(chief: str, num_nodes: int,
              environ: MutableMapping[str, str] | None = None) -> Choice | None:
    """Sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in `environ` (default: this process's
    environment) to the interface `choose` picks for reaching host `chief`, when the world
    spans several machines (`num_nodes` > 1) and the user chose none; logs the choice at
    INFO. Returns the choice, or None when nothing was set."""
    env = os.environ if environ is None else environ
    if num_nodes <= 1 or user_choice(env) is not None:
        return None
    choice = choose(chief)
    if choice is None:
        return None
    for name in USER_VARIABLES:
        env[name] = choice.interface
    logger.info(f"torchstrategy: using network interface {choice.interface} "
                f"({choice.address}) for the replicas' traffic: {choice.reason}. Set "
                "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to choose another.")
    return choice


def advertised_address(environ: MutableMapping[str, str] | None = None) -> str:
    """The address this process's gloo device advertises to its peers, described:
    "10.0.0.2 (eth0, GLOO_SOCKET_IFNAME)" or "127.0.1.1 (hostname 'node1')"."""
    env = os.environ if environ is None else environ
    interface = env.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        addresses = [a for a in interface_addresses().get(interface, []) if "." in a] or \
            interface_addresses().get(interface, [])
        shown = addresses[0] if addresses else "no address"
        return f"{shown} ({interface}, GLOO_SOCKET_IFNAME)"
    return f"{hostname_address() or 'unresolvable'} (hostname {socket.gethostname()!r})"


# -- when the machines cannot connect ------------------------------------------------------
# Where replica N records, before creating the process group, the address it advertises.
ADVERTISED_KEY = "torchstrategy/network/advertised/{}"
# How many replicas have read every address: the store's host (rank 0 under TF_CONFIG and
# srun) must not exit with its error before the others have read theirs from it.
_READ_COUNT_KEY = "torchstrategy/network/read"
# How long the diagnosis may spend reading the store (its host may be unreachable too).
_READ_SECONDS = 5.0
_ADDRESS_IN_ERROR = re.compile(r"\[?(\d{1,3}(?:\.\d{1,3}){3})\]?:(\d+)")


@dataclasses.dataclass(frozen=True)
class Advertised:
    """What one replica tells its peers: its machine index, hostname and address (as
    `advertised_address` describes it)."""

    rank: int
    machine: int
    hostname: str
    address: str

    @property
    def ip(self) -> str:
        return self.address.split(" ")[0]

    def __str__(self) -> str:
        return f"replica {self.rank} on {self.hostname} (machine {self.machine}): {self.address}"


def exchange_addresses(store: dist.Store, rank: int, node_rank: int, world_size: int,
                       timeout_seconds: float) -> dict[int, Advertised]:
    """Records in `store` what replica `rank` (on machine `node_rank`) advertises, waits
    (at most `timeout_seconds`, as creating the process group would) for every replica's,
    and checks them: returns rank -> `Advertised`.

    Raises:
      RuntimeError: a replica never arrived (naming the machines that did not), or a
        machine advertises a loopback address while the replicas span several machines
        (naming it and the fix) -- on every replica at once, before the backend blocks.
    """
    store.set(ADVERTISED_KEY.format(rank),
              f"{node_rank}\t{socket.gethostname()}\t{advertised_address()}")
    keys = [ADVERTISED_KEY.format(r) for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_seconds))
    except Exception:  # the store's timeout error type differs across torch versions
        pass
    listing = _read_advertised(store, world_size)
    if listing is None:
        raise RuntimeError(
            f"torchstrategy: replica {rank} on {socket.gethostname()} (machine {node_rank}) "
            "lost the rendezvous store while the replicas exchanged their addresses: the "
            "chief's machine is down or unreachable from this one.")
    missing = [r for r in range(world_size) if r not in listing]
    if missing:
        arrived = "; ".join(str(a) for _, a in sorted(listing.items()))
        raise RuntimeError(
            f"torchstrategy: replica(s) {missing} did not reach the rendezvous store within "
            f"{timeout_seconds:g} s (the replicas that did: {arrived}). Start the job on "
            "every machine, and check that each can reach the chief's address and port.")
    hostnames = {a.hostname for a in listing.values()}
    unreachable = [a for a in listing.values() if is_loopback(a.ip)]
    if unreachable and len(hostnames) > 1:
        # Every replica raises this same error; none may take the store down with it
        # while another still reads (that one would only see a broken pipe).
        _wait_until_every_replica_has_read(store, world_size)
        raise RuntimeError(
            f"torchstrategy: the replicas run on {len(hostnames)} machines, but "
            f"{'; '.join(str(a) for a in unreachable)} advertise(s) a loopback address, "
            "which the other machines cannot connect to. Fix: set GLOO_SOCKET_IFNAME (and "
            "NCCL_SOCKET_IFNAME) on every machine to the interface the machines reach each "
            "other on (`ip -br addr`), or unset them to let torchstrategy pick it, or map "
            "each hostname to the machine's own address in /etc/hosts.")
    return listing


def _wait_until_every_replica_has_read(store: dist.Store, world_size: int) -> None:
    """Counts this replica as having read every address, then waits (at most
    `_READ_SECONDS`) until all `world_size` replicas have; returns early if the store
    stops answering (each call bounded: its host may be gone)."""
    bounded = rendezvous.BoundedStore(store, _READ_SECONDS)
    deadline = time.monotonic() + _READ_SECONDS
    try:
        count = bounded.add(_READ_COUNT_KEY, 1)
        while count < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
            count = bounded.add(_READ_COUNT_KEY, 0)
    except (RuntimeError, OSError, ValueError):
        pass


def _read_advertised(store: dist.Store, world_size: int) -> dict[int, Advertised] | None:
    """rank -> `Advertised` for the replicas that published, each store call answered within
    `_READ_SECONDS` (None when one was not, or failed: the store's host may be unreachable,
    and after one unanswered call the others fail at once, so this returns within about
    `_READ_SECONDS`)."""
    bounded = rendezvous.BoundedStore(store, _READ_SECONDS)
    found: dict[int, Advertised] = {}
    try:
        for rank in range(world_size):
            key = ADVERTISED_KEY.format(rank)
            if bounded.check([key]):
                machine, hostname, address = bounded.get(key).decode().split("\t")
                found[rank] = Advertised(rank, int(machine), hostname, address)
    except (RuntimeError, OSError, ValueError):
        return None
    return found


def connection_error(error: BaseException, rank: int, node_rank: int,
                     advertised: dict[int, Advertised] | None, timeout_seconds: float
                     ) -> RuntimeError:
    """The error replica `rank` raises when its process group could not be created
    because the replicas could not connect: the backend's first line, the address every
    replica advertised (`advertised`, from `exchange_addresses`; None when unknown: this
    replica's own), which machine could not reach which, and the fix."""
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:400]
    me = f"replica {rank} on {socket.gethostname()} (machine {node_rank})"
    parts = [f"torchstrategy: {me} could not connect to the other replicas within "
             f"{timeout_seconds:g} s while creating the process group ({type(error).__name__}:"
             f" {first_line})."]
    target = _ADDRESS_IN_ERROR.search(str(error))
    if advertised:
        parts.append("The replicas advertised: "
                     f"{'; '.join(str(a) for _, a in sorted(advertised.items()))}.")
        if target is not None:
            holders = [a for _, a in sorted(advertised.items()) if a.ip == target.group(1)
                       and not (is_loopback(a.ip) and a.machine != node_rank)]
            if holders:
                parts.append(f"{me[0].upper()}{me[1:]} could not reach replica "
                             f"{holders[0].rank} on {holders[0].hostname} (machine "
                             f"{holders[0].machine}) at {target.group(1)}:{target.group(2)}.")
    else:
        parts.append(f"This replica advertised {advertised_address()}.")
    parts.append(
        "Fix: check that every machine is up and started the job, that each advertised "
        "address is the machine's address on the network the machines share (else set "
        "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to that interface on every machine), and "
        "that the machines can open TCP connections to each other on any port (gloo "
        "listens on random ports: a firewall must allow them between the machines).")
    return RuntimeError(" ".join(parts))
