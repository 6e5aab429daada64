"""The rpc world of a parameter-server cluster: who is in it, how to reach them, timeouts.

One torch.distributed.rpc world (TensorPipe) holds the chief, the workers and the parameter
servers, named after their task: ``"chief:0"``, ``"worker:1"``, ``"ps:0"``. It is a *dynamic*
rpc group (``init_rpc`` without ``world_size``), so a worker that dies can be dropped from
the group and a restarted process with the same task name can join again.

Where things listen:
- the rendezvous store (a TCPStore) is hosted by the chief on exactly the chief's address
  from the cluster spec (the socket is bound here and handed to the store), or, without a
  chief, by worker 0 on its address;
- each member's TensorPipe listener binds the network interface that carries this task's
  address in the cluster spec (``TP_SOCKET_IFNAME``), on a port the OS picks; only the
  "uv" (TCP) transport and the "basic" channel are enabled, so nothing else is opened.

Trust model: cluster members trust each other. Rpc messages carry pickled Python calls, so
any process that can reach a member's port can run code there. Run a cluster only on a
network you control (the addresses in the spec), as with TensorFlow's servers.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch.distributed as dist
import torch.distributed.rpc as rpc

from torchstrategy import _compat, runtime
from torchstrategy.cluster_resolver.cluster_spec import ClusterSpec, parse_address
from torchstrategy.launch import network

JOBS = ("chief", "worker", "ps")
DEFAULT_RPC_TIMEOUT_SECONDS = 60.0
# How long a member waits for the chief's store when it starts first.
DEFAULT_STARTUP_TIMEOUT_SECONDS = 300.0
_RENDEZVOUS_SCHEME = "torchstrategy-ps"
_NEXT_RANK_KEY = "torchstrategy/next_rank"
# torch.distributed.rpc keeps its group state in the store under "rpc_prefix_<n>/", n
# counting init_rpc calls in the process; every member of one cluster must use the same n, so
# it is reset to 0 before joining (each cluster has its own fresh store).
_RPC_PREFIX = "rpc_prefix_0"
_ALL_WORKER_INFOS = "names/_ALL_WORKER_INFOS"
_MEMBERSHIP_TOKEN = "RpcGroupManagementToken"

logger = logging.getLogger("torchstrategy")


def task_name(job: str, index: int) -> str:
    """The rpc name of a task: ``"worker:1"``."""
    return f"{job}:{index}"


def store_task(spec: ClusterSpec) -> tuple[str, int]:
    """``(job, index)`` of the task that hosts the rendezvous store: the chief, else worker 0."""
    if "chief" in spec.jobs and spec.num_tasks("chief"):
        return "chief", spec.task_indices("chief")[0]
    if "worker" in spec.jobs and spec.num_tasks("worker"):
        return "worker", spec.task_indices("worker")[0]
    raise ValueError(f"A parameter-server cluster needs a chief (or a worker 0) to host the "
                     f"rendezvous: {spec!r}.")


def check_cluster(spec: ClusterSpec) -> None:
    """Raises ValueError naming the fix when `spec` cannot run parameter-server training."""
    for job in spec.jobs:
        if job not in JOBS + ("evaluator",):
            raise ValueError(f"Unknown job {job!r} in the cluster spec; a parameter-server "
                             f"cluster has jobs {list(JOBS)} (and optionally 'evaluator').")
    for job in ("worker", "ps"):
        if job not in spec.jobs or spec.num_tasks(job) == 0:
            raise ValueError(f"ParameterServerStrategy needs at least one {job!r} task in the "
                             f"cluster spec, got {spec.as_dict()!r}.")
    store_task(spec)
    # Every task listens on its own address: two tasks given one would never both join
    # (the second cannot listen there), and the chief would wait its whole startup_timeout.
    seen: dict[tuple[str, int], str] = {}
    for job in spec.jobs:
        for index in spec.task_indices(job):
            host, port = parse_address(spec.task_address(job, index))
            key = (host.lower(), port)
            if key in seen:
                raise ValueError(
                    f"The cluster spec gives {task_name(job, index)} and {seen[key]} the same "
                    f"address {spec.task_address(job, index)}: every task needs its own "
                    f"host:port (tasks on one machine need different ports).")
            seen[key] = task_name(job, index)


# -- network interfaces ------------------------------------------------------------------

def _interface_ipv4(name: str) -> str | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(sock.fileno(), 0x8915,  # SIOCGIFADDR
                             struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        sock.close()


def resolve_ipv4(host: str) -> str:
    """`host` (an IPv4 literal or a host name) as an IPv4 address.

    Raises:
      ValueError: a name that does not resolve.
    """
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:  # not a literal IPv4 address: a host name, resolved below
        host = str(host)
    try:
        return socket.gethostbyname(host)
    except OSError as err:
        raise ValueError(f"Cannot resolve host {host!r} from the cluster spec: {err}.") from None


def interface_for(host: str) -> str:
    """The name of the local network interface whose IPv4 address is `host`'s.

    Raises:
      ValueError: when no interface of this machine has that address (the task was started
        on the wrong machine, or the spec names an address this machine does not have).
    """
    ip = resolve_ipv4(host)
    loopback = ipaddress.IPv4Address(ip).is_loopback
    for _, name in socket.if_nameindex():
        address = _interface_ipv4(name)
        if address == ip or (loopback and address is not None
                             and ipaddress.IPv4Address(address).is_loopback):
            return name
    raise ValueError(f"No network interface of this machine has the address {ip} "
                     f"(host {host!r} in the cluster spec): start this task on the machine the "
                     f"spec names, or fix the spec.")


# -- rendezvous --------------------------------------------------------------------------

def _outward_name(spec: ClusterSpec, host: str) -> tuple[str, str] | None:
    """(interface, address) the other machines reach this one at, when the spec names this
    machine `host` by a name that resolves to loopback here (Debian's /etc/hosts maps the
    hostname to 127.0.1.1) and names other machines too; None otherwise."""
    if host == "localhost" or not ipaddress.IPv4Address(resolve_ipv4(host)).is_loopback:
        return None
    with contextlib.suppress(ValueError):
        ipaddress.IPv4Address(host)
        return None   # a loopback IP: the cluster is on this machine
    hosts = [parse_address(spec.task_address(job, i))[0] for job in spec.jobs
             for i in spec.task_indices(job)]
    if all(ipaddress.IPv4Address(resolve_ipv4(h)).is_loopback for h in hosts):
        return None
    return network.outward_interface()


def _bound_listen_fd(host: str, port: int, spec: ClusterSpec | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        # This machine's name mapped to loopback: listen where the others reach it, too.
        outward = _outward_name(spec, host) if spec is not None else None
        sock.bind(("0.0.0.0" if outward else resolve_ipv4(host), port))
    except OSError as err:
        sock.close()
        raise OSError(f"Cannot listen on {host}:{port} (the rendezvous address of the cluster "
                      f"spec): {err}.") from None
    sock.listen(128)
    return sock


def make_store(spec: ClusterSpec, is_host: bool, timeout_seconds: float) -> dist.TCPStore:
    """The rendezvous TCPStore: hosted on exactly the store task's spec address when
    `is_host`, otherwise a client of it (waiting up to `timeout_seconds` for it to appear)."""
    host, port = parse_address(spec.task_address(*store_task(spec)))
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if is_host:
        # The store gets a socket already bound to the spec's address, so it listens there
        # only (a TCPStore binds every interface otherwise). The store owns the descriptor.
        fd = _bound_listen_fd(host, port, spec).detach()
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                             timeout=timeout, master_listen_fd=fd, use_libuv=False)
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            return dist.TCPStore(host, port, is_master=False, timeout=timeout)
        except (RuntimeError, dist.DistStoreError) as err:
            if time.monotonic() > deadline:
                raise TimeoutError(f"The cluster's rendezvous at {host}:{port} did not answer "
                                   f"within {timeout_seconds:.0f} s: {err}") from None
            time.sleep(0.5)


class _RpcWorldState:
    """This process's place in a parameter-server rpc world (``runtime.current().state``).

    `members_changed` is notified whenever a member joins (the joining member tells the
    store host, `member_joined`) or is dropped, so waits for members block on it.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.membership: Membership | None = None
        # (store, rank) handed to the rendezvous handler
        self.pending_store: tuple[dist.Store, int] | None = None
        self.members_changed = threading.Condition()


def _state() -> _RpcWorldState:
    return runtime.current().state("parameter_server.rpc_world", _RpcWorldState)


def _rendezvous_handler(url: str, **kwargs: Any) -> Iterator[tuple[dist.Store, int, None]]:
    state = _state()
    if state.pending_store is None:
        raise RuntimeError("torchstrategy's parameter-server rendezvous was used outside "
                           "rpc_world.join.")
    store, rank = state.pending_store
    state.pending_store = None
    yield store, rank, None  # dynamic group: no world size


def _install_rendezvous_handler() -> None:
    dist.register_rendezvous_handler(_RENDEZVOUS_SCHEME, _rendezvous_handler)


def live_members() -> dict[str, int]:
    """``{name: rank}`` of the members this process's rpc agent currently knows."""
    agent = _compat.current_rpc_agent()
    return {info.name: info.id for info in agent.get_worker_infos()}


class Membership:
    """This process's place in the rpc world (one per process)."""

    def __init__(self, spec: ClusterSpec, job: str, index: int, store: dist.Store,
                 rpc_timeout: float) -> None:
        self.spec = spec
        self.job = job
        self.index = index
        self.name = task_name(job, index)
        self.store = store
        self.rpc_store = dist.PrefixStore(_RPC_PREFIX, store)
        self.rpc_timeout = rpc_timeout
        self._leave_callbacks: list[Callable[[], Any]] = []

    def on_leave(self, callback: Callable[[], Any]) -> None:
        """Calls `callback()` when this process leaves the rpc world (`leave`), before its
        agent shuts down: threads that use rpc are told to stop while it still works."""
        self._leave_callbacks.append(callback)

    def run_leave_callbacks(self) -> None:
        """Called by `leave`; each callback runs once."""
        callbacks, self._leave_callbacks = self._leave_callbacks, []
        for callback in callbacks:
            callback()

    def live_members(self) -> dict[str, int]:
        """``{name: rank}`` of the members the local rpc agent currently knows."""
        return live_members()

    def wait_for_members(self, names: Iterable[str], timeout: float) -> set[str]:
        """Blocks until every name in `names` is a live member, or until `timeout` seconds
        passed; returns the names still missing (empty when all joined)."""
        condition = _state().members_changed
        deadline = time.monotonic() + timeout
        with condition:
            while True:
                missing = set(names) - set(self.live_members())
                remaining = deadline - time.monotonic()
                if not missing or remaining <= 0:
                    return missing
                # Woken by `member_joined`; the bound re-checks for a member whose notice
                # was lost (it joined while this process was still starting its agent).
                condition.wait(min(remaining, 1.0))

    def drop(self, name: str, rank: int) -> None:
        """Removes a dead member from the group: from the store (so that processes joining
        later do not wait for it) and from this process's agent. Other members drop it when
        they hear about it (`drop_local`)."""
        _with_membership_token(self.rpc_store, f"drop-{name}", lambda: _remove_name(
            self.rpc_store, name, rank))
        drop_local(name, rank)


def member_joined(name: str) -> bool:
    """Rpc target on the store host: the member `name` has just joined the rpc world."""
    condition = _state().members_changed
    with condition:
        condition.notify_all()
    return True


def drop_local(name: str, rank: int) -> bool:
    """Forgets a dead member in this process's rpc agent (a no-op if already forgotten)."""
    if live_members().get(name) != rank:
        return False
    _compat.rpc_forget_member(_compat.current_rpc_agent(), name, rank)
    condition = _state().members_changed
    with condition:
        condition.notify_all()
    return True


def call_each(names: Iterable[str], fn: Callable[..., Any],
              args: Sequence[Any] | Callable[[str], Sequence[Any]],
              timeout: float) -> dict[str, BaseException]:
    """Runs ``fn(*args)`` on every member in `names` at once and waits for all of them,
    each call bounded by `timeout` seconds, so dead or silent members cannot hang the
    caller nor keep the others from being called.

    Args:
      args: the arguments, the same for every member, or a function of the member's name
        returning its arguments.

    Returns:
      ``{name: error}`` of the calls that failed: a member the agent already knows is gone
      (the RuntimeError of sending), or a call that failed or timed out (whatever waiting
      raised, the callee's own error included). Empty when every call succeeded.
    """
    futures: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    for name in names:
        try:
            futures[name] = rpc.rpc_async(name, fn, args=args(name) if callable(args) else args,
                                          timeout=timeout)
        except RuntimeError as error:  # the agent already knows the member is gone
            errors[name] = error
    for name, future in futures.items():
        try:
            future.wait()
        except Exception as error:  # gone, silent, or the callee's own: the caller sorts out
            errors[name] = error
    return errors


def _with_membership_token(store: dist.Store, label: str, fn: Callable[[], Any]) -> Any:
    token = f"Token_for_{label}"
    deadline = time.monotonic() + 60
    while True:
        returned = store.compare_set(_MEMBERSHIP_TOKEN, "", token).decode()
        if returned == token:
            try:
                return fn()
            finally:
                store.set(_MEMBERSHIP_TOKEN, "")
                store.set(token, "Done")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Could not take the rpc membership token (held by {returned}).")
        try:
            # Blocks until the holder marks its token done.
            store.wait([returned], datetime.timedelta(seconds=5))
        except (RuntimeError, dist.DistStoreError):
            # Not done within 5 s (the holder may have died holding it): try again, bounded
            # by the deadline above.
            continue


def _remove_name(store: dist.Store, name: str, rank: int) -> None:
    entry = f"{name}-{rank},"
    if not store.check([_ALL_WORKER_INFOS]):
        return
    infos = store.get(_ALL_WORKER_INFOS).decode()
    if entry in infos:
        store.set(_ALL_WORKER_INFOS, infos.replace(entry, ""))


def current() -> Membership | None:
    """This process's `Membership`, or None when it is not in a cluster."""
    return _state().membership


def join(spec: ClusterSpec, job: str, index: int,
         rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SECONDS,
         startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_SECONDS) -> Membership:
    """Joins the cluster's rpc world as task ``job:index`` and returns its `Membership`.

    Idempotent for the same task in one process. The task's own spec address selects the
    interface to listen on; the store task hosts the rendezvous on its spec address. A
    member that is not the store host tells the host it joined (`member_joined`).

    Raises:
      ValueError: bad spec or task, or an address this machine does not have.
      RuntimeError: when this process is already another task of a cluster.
      TimeoutError: when the rendezvous does not answer within `startup_timeout`.
    """
    state = _state()
    with state.lock:
        current_membership = state.membership
        if current_membership is not None:
            if (current_membership.spec, current_membership.job,
                    current_membership.index) == (spec, job, index):
                return current_membership
            raise RuntimeError(f"This process is already {current_membership.name} of "
                               f"cluster {current_membership.spec!r}; a process can be one "
                               f"task of one cluster at a time.")
        check_cluster(spec)
        runtime.current().install_once("parameter_server.rendezvous",
                                       _install_rendezvous_handler)
        host, _ = parse_address(spec.task_address(job, index))
        outward = _outward_name(spec, host)
        os.environ["TP_SOCKET_IFNAME"] = outward[0] if outward else interface_for(host)
        host_task = store_task(spec)
        is_host = (job, index) == host_task
        store = make_store(spec, is_host, startup_timeout)
        rank = 0 if is_host else store.add(_NEXT_RANK_KEY, 1)
        options = _compat.tensorpipe_tcp_options(f"{_RENDEZVOUS_SCHEME}://", rpc_timeout,
                                                 num_worker_threads=16)
        state.pending_store = (store, rank)
        _compat.reset_rpc_init_counter()
        rpc.init_rpc(task_name(job, index), rank=rank, world_size=None,
                     rpc_backend_options=options)
        state.membership = Membership(spec, job, index, store, rpc_timeout)
    if not is_host:
        try:
            rpc.rpc_sync(task_name(*host_task), member_joined, args=(task_name(job, index),),
                         timeout=rpc_timeout)
        except RuntimeError as error:
            # The host learns of us anyway (its waits re-check the group); it may just be
            # gone, which the server's chief check reports.
            logger.debug(f"could not tell {task_name(*host_task)} that we joined: {error}")
    return state.membership


def leave() -> None:
    """Leaves the rpc world without waiting for the others (dead peers cannot hang it).

    Bounded: if TensorPipe does not finish shutting down within a few seconds the agent is
    abandoned (the process is about to end or to start no other cluster)."""
    state = _state()
    with state.lock:
        membership = state.membership
        if membership is None:
            return
        membership.run_leave_callbacks()
        done = threading.Event()

        def shutdown() -> None:
            try:
                rpc.shutdown(graceful=False)
            except RuntimeError as error:
                # Peers already gone: the agent is torn down all the same.
                logger.debug(f"rpc shutdown: {error}")
            finally:
                done.set()

        threading.Thread(target=shutdown, name="torchstrategy-rpc-shutdown",
                         daemon=True).start()
        done.wait(10.0)
        state.membership = None
