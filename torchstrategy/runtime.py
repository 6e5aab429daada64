"""The process's distributed lifetime, owned by one object: `Runtime` (``current()``).

A process joins at most one distributed world, whichever strategies it creates. The runtime
holds everything about that membership that must outlive a single strategy object:

- the `World` this process found or established (rank, world size, launcher, store);
- the re-execution supervisor, when a plain ``python train.py`` became N replicas;
- the default process group it initialised (or adopted), always under a timeout;
- the buffers collectives handed to a backend thread, kept alive until released;
- the gradient reducers whose C++ cores reference the process group;
- state and clean-up of higher layers (parameter-server services, sub-groups), registered
  with `state` and `on_shutdown`, so that no module keeps distributed state of its own.

Shutdown happens once, at interpreter exit (or `shutdown()`), in this order:

0. unless an exception ended the program, tell the other replicas that this one finished
   (`announce_finished`);
1. ``on_shutdown`` callbacks, last registered first (rpc services, sub-groups);
2. on re-execution's replica 0: wait for the other replicas (their exit code decides the
   job's), releasing our end of the group if they take too long;
3. wait until the backend let go of every held buffer; close every reducer's C++ core;
4. destroy the default process group, while the interpreter is still whole (a group left
   to teardown can abort the process: "terminate called without an active exception").

Nothing happens at import: the first strategy that needs a world creates the runtime; no
thread, socket or exit handler exists before.
"""
from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
import sys
import threading
import time
import traceback
import types
import atexit
import weakref
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from torchstrategy import _compat
from torchstrategy.cluster_resolver import detect
from torchstrategy.cluster_resolver.base import ClusterResolver
from torchstrategy.launch import network, reexec, rendezvous, sockets
from torchstrategy.launch import world as world_lib

logger = logging.getLogger("torchstrategy")

_T = TypeVar("_T")


# How long `Runtime.abandon_process_group` lets the collectives in flight end before it
# breaks the group's connections: a collective among live peers ends in milliseconds; one
# with a lost peer fails at once or never (a link down), and that one costs this much.
ABANDON_DRAIN_SECONDS = 1.0


class Runtime:
    """This process's membership in a distributed world (see the module docstring).

    Obtain it with ``torchstrategy.runtime.current()``; never construct one yourself.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._world: world_lib.World | None = None
        self._supervisor: reexec.Supervisor | None = None
        self._watching_parent = False
        self._watching_interrupts = False
        self._owns_group = False
        self._held: list[torch.Tensor] = []
        self._held_lock = threading.Lock()
        self._reducers: weakref.WeakSet[Any] = weakref.WeakSet()
        # (name, fn) run at shutdown, last first
        self._callbacks: list[tuple[str, Callable[[], Any]]] = []
        self._installed: set[str] = set()   # keys of one-time process-wide installs
        self._state: dict[str, Any] = {}    # key -> state object of a higher layer
        self._exit_handler_registered = False
        self._shut_down = False
        self._announced = False       # announce_finished ran
        self._store: dist.Store | None = None  # the store our process group was made with
        # The sockets making our default process group opened (see `group_sockets`).
        self._group_sockets: frozenset[str] = frozenset()
        # Threads freeing abandoned groups (`abandon_process_group`), joined at release.
        self._freeing: list[threading.Thread] = []
        self._group_timeout = 0.0   # the collective timeout of the groups made here

    # -- the world ------------------------------------------------------------------
    @property
    def world(self) -> world_lib.World | None:
        """The `World` this process belongs to, or None before any strategy made one."""
        return self._world

    def enter_world(self, world: world_lib.World) -> world_lib.World:
        """Records `world` as this process's world (a second strategy joins it instead of
        launching again) and gives the process torchrun's variables for it
        (`world_lib.publish_environment`: RANK, LOCAL_RANK, WORLD_SIZE, ...; a launcher's
        own values are never replaced). Re-executed replicas start watching their replica
        0 here."""
        with self._lock:
            self._world = world
            world_lib.publish_environment(world)
            if world.launcher == "reexec" and world.rank > 0 and not self._watching_parent:
                self._watching_parent = True
                reexec.watch_parent()
            if world.launcher == "torchrun" and not self._watching_interrupts:
                # torchrun forwards Ctrl-C to its workers, which a collective would hold
                # until its timeout (issue 36, item 5).
                self._watching_interrupts = True
                reexec.exit_when_interrupted_while_blocked(world.rank)
        return world

    def start_alone(self, timeout_seconds: float) -> world_lib.World:
        """Becomes a world of one replica (a plain process whose strategy has one): rank 0
        of 1, with a rendezvous store of its own on a loopback port the OS picks, which
        MASTER_PORT names as torchrun's would; returns the `World`, which carries the
        store for the process group of one."""
        with self._lock:
            store = reexec.listening_store("127.0.0.1", 1,
                                           datetime.timedelta(seconds=timeout_seconds))
            return self.enter_world(world_lib.World(master_port=store.port, store=store))

    def start_local_replicas(self, num_replicas: int, timeout_seconds: float,
                             **multi_machine: Any) -> world_lib.World:
        """Becomes replica 0 of `num_replicas` local replicas by re-executing this program
        (see `torchstrategy.launch.reexec.start_local_replicas`); returns the `World`."""
        with self._lock:
            world, supervisor = reexec.start_local_replicas(num_replicas, timeout_seconds,
                                                            **multi_machine)
            if supervisor is not None:
                self._supervisor = supervisor
                supervisor.install_excepthook()
                self._register_exit_handler()
            return self.enter_world(world)

    # -- the process group ------------------------------------------------------------
    def init_process_group(self, world: world_lib.World, backend: str,
                           timeout_seconds: float) -> None:
        """Creates (or adopts) the default process group for `world`; returns None, which
        torch.distributed reads as "the default group".

        A group created beforehand (``dist.init_process_group``) is adopted if its size
        matches. Every collective on the group is bounded by `timeout_seconds`. No Python
        reference to the group object is kept: one referenced into interpreter teardown is
        destroyed in the wrong order and can abort the process.

        A group made by someone else (Ray Train, Accelerate, the user) stays theirs: it is
        used as it is and never destroyed here.

        Raises:
          RuntimeError: an existing group whose size or rank disagrees with `world`.
        """
        if dist.is_initialized():
            if dist.get_world_size() != world.world_size or dist.get_rank() != world.rank:
                raise RuntimeError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but this strategy's world ({world.launcher}) is "
                    f"rank {world.rank} of {world.world_size} replicas (RANK, WORLD_SIZE). "
                    "Create the strategy with matching devices, or destroy the existing "
                    "process group first.")
            if not self._owns_group:
                logger.info(f"torchstrategy: adopting the existing default process group "
                            f"({dist.get_backend()}, rank {world.rank} of {world.world_size}); "
                            "it stays its creator's to destroy")
            return None
        timeout = datetime.timedelta(seconds=timeout_seconds)
        self._group_timeout = timeout_seconds
        with self._lock:
            self._owns_group = True
            self._register_exit_handler()
        if world.launcher == "torchrun":
            # A single-machine torchrun's restarted rounds get keys of their own (see
            # rendezvous.torchrun_store); otherwise torch reads its environment.
            store = rendezvous.torchrun_store(world, timeout)
        elif world.store is None and world.launcher in detect.STORE_ON_RANK_0 and \
                world.rank == 0:
            # srun started every replica: rank 0 serves the rendezvous at the address
            # every task derived from the same variables.
            store = reexec.listening_store(world.master_addr, world.world_size, timeout,
                                           port=world.master_port)
        else:
            store = world.store if world.store is not None else rendezvous.connect(
                world.master_addr, world.master_port, world.world_size, timeout)
        # Several machines: the interface the others reach, unless the user chose one.
        network.configure(world.master_addr, world.num_nodes)
        advertised = None
        if store is not None and world.num_nodes > 1:
            advertised = network.exchange_addresses(store, world.rank, world.node_rank,
                                                    world.world_size, timeout_seconds)
        before = sockets.socket_inodes()
        try:
            if store is None:
                dist.init_process_group(backend, init_method="env://", timeout=timeout)
            else:
                dist.init_process_group(backend, store=store, rank=world.rank,
                                        world_size=world.world_size, timeout=timeout)
                self._store = store
            self._group_sockets = sockets.opened_since(before, world.master_port or None)
        except (RuntimeError, OSError) as error:  # gloo / TCPStore's DistError included
            if world.num_nodes <= 1:
                raise
            raise network.connection_error(error, world.rank, world.node_rank, advertised,
                                           timeout_seconds) from error
        return None

    def abandon_process_group(self) -> None:
        """Live recovery's hook: destroys a default process group that a lost replica
        broke, at once, in a process that lives on. Unlike `release_process_group` (made
        for the exit) it neither waits for the backend's buffers (those of the broken
        collective may be let go of late; they stay held) nor runs the cycle collector
        (seconds in a large program); the reducers, which reference the group, are
        closed. Closing our end of the group makes a replica still blocked in a collective
        with this one fail at once instead of at its timeout. Idempotent.

        The reducers' collectives still in flight are given up to
        `ABANDON_DRAIN_SECONDS` to end first: a gloo collective running when its
        connections are shut down is not always woken, and stays until the collective
        timeout (seen: the flags' sum of the step a replica's own error broke, which the
        others completed)."""
        for reducer in list(self._reducers):
            reducer.drain(ABANDON_DRAIN_SECONDS)
            reducer.close()
        # Shut our end of the group's connections now: destroying the group closes them
        # only once nothing else holds it (the broken collective's work may hold it for a
        # while), and until then a replica blocked in a collective with this one waits for
        # its timeout (seen under load: a survivor waited 32 s in an all-reduce with a
        # replica already regrouping). gloo's only: NCCL's connections belong to its
        # bootstrap and proxy threads, and its watchdog ends a stalled collective.
        group_sockets, self._group_sockets = self._group_sockets, frozenset()
        if group_sockets and dist.is_initialized() and dist.get_backend() == "gloo":
            sockets.shut_down(group_sockets)
        if dist.is_initialized():
            group = [_compat.default_process_group()]
            _compat.release_group_from_functional_defaults(group[0])
            dist.destroy_process_group()
            # Freeing a gloo group joins its threads, and a thread still in the broken
            # collective stays there until the collective timeout: a gloo ring's send or
            # receive is not always woken by its connections closing (seen under load:
            # the replica that broke a step sat here for the whole timeout while the
            # others waited for it in the agreement). The last reference is dropped in a
            # thread of its own, so that this replica goes on with the recovery at once;
            # `release_process_group` joins it.
            freeing = threading.Thread(target=group.clear, daemon=True,
                                       name="torchstrategy-free-abandoned-group")
            freeing.start()
            self._freeing.append(freeing)
        self._store = None

    def _join_freeing(self) -> None:
        """Waits for the abandoned groups to be freed (at most the collective timeout in
        which their last collective can be stuck, plus a margin)."""
        freeing, self._freeing = self._freeing, []
        deadline = time.monotonic() + self._group_timeout + 10.0
        for thread in freeing:
            thread.join(max(0.0, deadline - time.monotonic()))

    def regroup(self, world: world_lib.World, backend: str, store: dist.Store,
                timeout_seconds: float) -> None:
        """Live recovery's hook (`torchstrategy.fault_tolerance.live_recovery`): replaces
        a broken default process group by a new one over `world` (the survivors), made
        with `store` (a prefix of the rendezvous store new for this generation, so no key
        of the old group is read), in this same process. The old group is abandoned first
        (`abandon_process_group`); `world` becomes this process's world (RANK,
        WORLD_SIZE... published again).

        Raises:
          RuntimeError: a survivor did not join the new group within `timeout_seconds`.
        """
        self.abandon_process_group()
        with self._lock:
            self._owns_group = True
            self._register_exit_handler()
            self._world = world
            world_lib.publish_environment(world)
        before = sockets.socket_inodes()
        self._group_timeout = timeout_seconds
        dist.init_process_group(backend, store=store, rank=world.rank,
                                world_size=world.world_size,
                                timeout=datetime.timedelta(seconds=timeout_seconds))
        self._group_sockets = sockets.opened_since(before, world.master_port or None)
        self._store = store

    def group_sockets(self) -> frozenset[str]:
        """The TCP sockets (inodes, `launch.sockets`) that making the default process group
        opened: its backend's connections to the other replicas and its listener, not the
        rendezvous store's (its port excluded: on replica 0 the store's server accepts
        other replicas' connections at any time, and those outlive the group). Empty for a group made by someone else, before any
        group, after it was abandoned, and where sockets cannot be listed (not Linux).
        Breaking them (`sockets.shut_down`) makes a collective blocked on an unreachable
        replica fail at once instead of at its timeout."""
        return self._group_sockets

    def rendezvous_store(self) -> dist.Store | None:
        """The store for torchstrategy's own keys about this world (roll calls, the end of
        a replica's program): the one our process group was made with, else the default
        group's (torch's env:// or an adopted group), else None (no group)."""
        return self._store if self._store is not None else _compat.default_store()

    def release_process_group(self) -> None:
        """Destroys the default process group if there is one (idempotent), once the backend
        has let go of every buffer our collectives gave it and no reducer references it.

        Destroyed means freed, with gloo's threads joined, here, while the interpreter is
        whole: torch's own references are dropped by ``destroy_process_group``, the
        reducers' by closing them, the one ``torch.distributed.nn.functional`` keeps in
        its default arguments by `_compat.release_group_from_functional_defaults`, and
        those of DeviceMesh and FSDP2 by `_compat.release_groups_from_device_meshes`.
        Otherwise the group and its threads outlive this into the interpreter's teardown,
        where they can abort the process ("terminate called without an active
        exception", docs/troubleshooting.md)."""
        self.wait_until_released()
        for reducer in list(self._reducers):
            reducer.close()
        self._group_sockets = frozenset()
        self._join_freeing()
        if dist.is_initialized():
            # Objects the program dropped that sit in reference cycles (a strategy and its
            # extended, their reducer, a pending Work) would be freed only by the cycle
            # collector, whose next run may be in the interpreter's teardown: run it now.
            # Objects frozen by `gc.freeze()` (a program may freeze what it built, to spare
            # the collector or its forked workers) are out of its reach, and one that has
            # since become garbage holding the group would outlive this (a Lightning script
            # that froze before its end kept both replicas' groups alive, and aborted now
            # and then): this last collection includes them.
            if gc.get_freeze_count():
                gc.unfreeze()
            gc.collect()
            # The last references are then torch's own: destroying the groups frees them.
            _compat.release_group_from_functional_defaults(_compat.default_process_group())
            groups = _compat.live_process_groups()
            _compat.release_groups_from_device_meshes(groups)
            dist.destroy_process_group()
            self._report_surviving_groups(groups)
        self._store = None
        self._group_sockets = frozenset()

    @staticmethod
    def _report_surviving_groups(groups: list[dist.ProcessGroup]) -> None:
        """Warns, naming the holders, about every group of `groups` (just destroyed) that
        something other than `groups` still references; then drops `groups`, which frees
        (and joins the threads of) every other one here.

        A group that survives its destruction is freed in the interpreter's teardown, if
        at all, where gloo's threads can abort the process; every such reference found so
        far was a bug of ours (fixed where it was made), so one found here is said
        loudly, with where it is, instead of surfacing as a rare abort."""
        for index in range(len(groups)):
            # the list's own reference and getrefcount's argument
            if sys.getrefcount(groups[index]) <= 2:
                continue
            holders = _describe_holders(groups[index], ignore=groups)
            # stderr, as the supervisor's messages: seen without logging configured
            print("torchstrategy: a process group is still referenced after it was "
                  f"destroyed at exit (by {'; '.join(holders) or 'an object outside Python'}"
                  "); its threads will meet the interpreter's teardown, which can abort the "
                  "process (\"terminate called without an active exception\"). Drop that "
                  "reference before the program ends.", file=sys.stderr, flush=True)
        groups.clear()

    # -- buffers in flight -----------------------------------------------------------
    def hold(self, *buffers: torch.Tensor) -> None:
        """Keeps `buffers` referenced until no collective uses them any more.

        gloo's worker thread drops its reference to a finished collective a moment after
        ``wait()`` returns; if Python had already dropped the buffer, that last release
        needs the GIL from the worker thread, which aborts the process when it happens
        during interpreter shutdown.
        """
        with self._held_lock:
            self._held[:] = [b for b in self._held if _compat.tensor_use_count(b) > 1]
            self._held.extend(buffers)

    def wait_until_released(self, timeout_seconds: float = 10.0) -> bool:
        """Waits (bounded) until the backend has released every held buffer; returns
        whether it did."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            with self._held_lock:
                self._held[:] = [b for b in self._held if _compat.tensor_use_count(b) > 1]
                if not self._held:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    # -- reducers ---------------------------------------------------------------------
    def track_reducer(self, reducer: Any) -> None:
        """`reducer.close()` is called before the process group is destroyed."""
        self._reducers.add(reducer)

    def interrupt_gradient_reductions(self, interrupted: bool) -> None:
        """Live recovery's hook, safe from any thread: with `interrupted`, a gradient
        all-reduce that a reducer waits for on a gloo group gives up within a fraction of
        a second and fails as a broken connection (the group is being abandoned: no
        collective of it can complete); without, waits are normal again."""
        for reducer in list(self._reducers):
            reducer.interrupt(interrupted)

    # -- higher layers' state and clean-up ----------------------------------------------
    def state(self, key: str, factory: Callable[[], _T]) -> _T:
        """The per-process state object of a higher layer, created by `factory()` on first
        use (e.g. the parameter-server's variables on a server process)."""
        with self._lock:
            if key not in self._state:
                self._state[key] = factory()
            return self._state[key]

    def install_once(self, key: str, install: Callable[[], Any]) -> None:
        """Calls `install()` the first time `key` is seen in this process (process-wide
        hooks, e.g. torch's global module registration hooks)."""
        with self._lock:
            if key in self._installed:
                return
            install()
            self._installed.add(key)

    def on_shutdown(self, name: str, callback: Callable[[], Any]) -> None:
        """Runs `callback()` at shutdown, before the process group is released; callbacks
        run last registered first. Registering the same `name` again replaces nothing and
        adds nothing."""
        with self._lock:
            if any(n == name for n, _ in self._callbacks):
                return
            self._callbacks.append((name, callback))
            self._register_exit_handler()

    # -- shutdown ---------------------------------------------------------------------
    def announce_finished(self) -> None:
        """Tells the other replicas, through the rendezvous store, that this one's program
        ended without an uncaught exception, so that a replica still waiting in a
        collective with it can say so (uneven numbers of steps) instead of "another replica
        died", and re-execution's supervisor waits for its exit code. Idempotent; bounded
        to a few seconds; does nothing without a process group."""
        with self._lock:
            if self._announced or not dist.is_initialized() or dist.get_world_size() == 1:
                return
            self._announced = True
        store = self.rendezvous_store()
        if store is None:
            return
        try:
            store.set_timeout(datetime.timedelta(seconds=5))
            store.set(world_lib.FINISHED_KEY.format(dist.get_rank()), "finished")
        except (RuntimeError, OSError):  # the store's host is gone: nobody left to tell
            pass

    def shutdown(self) -> None:
        """Ends this process's distributed life in the documented order (idempotent)."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            callbacks = list(reversed(self._callbacks))
            supervisor = self._supervisor
            owns_group = self._owns_group
        if getattr(sys, "last_value", None) is None:  # no uncaught exception ended the program
            self.announce_finished()
        for name, callback in callbacks:
            try:
                callback()
            except Exception as error:  # one failing clean-up must not skip the others
                logger.warning(f"clean-up {name!r} failed at exit: {error}")
        if supervisor is not None:
            # Replica 0 of a re-executed job: the other replicas still use the group; the
            # supervisor releases it once they finished (or after a bound).
            supervisor.at_exit(self.release_process_group)
        elif owns_group:
            self.release_process_group()

    def _at_exit(self) -> None:
        """The exit handler: `shutdown`, once an uncaught exception's frames let go.

        The traceback of an exception that ended the program (``sys.last_traceback``) keeps
        every frame it passed through alive, with their locals: a strategy, a reducer, a
        process group held by a variable would outlive the group's destruction into the
        interpreter's teardown. The traceback was printed already; its frames' locals are
        cleared so that the shutdown frees the group."""
        last = getattr(sys, "last_traceback", None)
        if last is not None:
            traceback.clear_frames(last)
        self.shutdown()

    def _register_exit_handler(self) -> None:
        if not self._exit_handler_registered:
            self._exit_handler_registered = True
            atexit.register(self._at_exit)


def _describe_holders(obj: Any, ignore: Any) -> list[str]:
    """Where `obj` is referenced from, in words (for the warning above): the function whose
    closure or default arguments hold it, the class of the object whose attribute it is,
    the frame whose local it is; else the container's type. `ignore`: a referrer to skip."""
    described = []
    for referrer in gc.get_referrers(obj):
        if referrer is ignore or (isinstance(referrer, types.FrameType)
                                  and referrer.f_code is _describe_holders.__code__):
            continue
        owners = [o for o in gc.get_referrers(referrer) if o is not ignore]
        if isinstance(referrer, types.CellType):
            functions = [f for tup in owners if isinstance(tup, tuple)
                         for f in gc.get_referrers(tup) if isinstance(f, types.FunctionType)
                         and f.__closure__ is tup]
            described += [f"the closure of {f.__qualname__} ({f.__code__.co_filename}:"
                          f"{f.__code__.co_firstlineno})" for f in functions] or ["a closure"]
        elif isinstance(referrer, types.FrameType):
            code = referrer.f_code
            described.append(f"a local of {code.co_name} ({code.co_filename}:"
                             f"{referrer.f_lineno})")
        elif isinstance(referrer, tuple) and any(
                isinstance(f, types.FunctionType) and f.__defaults__ is referrer
                for f in owners):
            described += [f"the default arguments of {f.__qualname__}" for f in owners
                          if isinstance(f, types.FunctionType) and f.__defaults__ is referrer]
        elif isinstance(referrer, dict) and any(
                getattr(o, "__dict__", None) is referrer for o in owners):
            described += [f"an attribute of a {type(o).__qualname__}" for o in owners
                          if getattr(o, "__dict__", None) is referrer]
        elif isinstance(referrer, (list, tuple, dict, set, frozenset)):
            described.append(f"a {type(referrer).__qualname__}")
        else:  # an instance whose attributes live inline (no __dict__ of their own)
            described.append(f"an attribute of a {type(referrer).__qualname__}")
    return described


class _Holder:
    """The process's runtime, re-made in a forked child (which is another process)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.runtime: Runtime | None = None


_holder = _Holder()
_holder_lock = threading.Lock()


def current() -> Runtime:
    """This process's `Runtime` (created on first use)."""
    with _holder_lock:
        if _holder.runtime is None or _holder.pid != os.getpid():
            _holder.runtime = Runtime()
            _holder.pid = os.getpid()
        return _holder.runtime


def world_from_environment(resolver: ClusterResolver | None = None
                           ) -> world_lib.World | None:
    """The world this process already joined; else the one a launcher described in the
    environment (torchrun, ts.launch, re-execution), or `resolver`'s / the detected srun
    step's (see `torchstrategy.cluster_resolver.detect`); else the world of a default
    process group someone else initialised (Ray Train, Accelerate, the user), adopted;
    else None for a plain process.

    Raises:
      ValueError: malformed or conflicting cluster variables, named.
    """
    runtime = current()
    return (runtime.world or world_lib.from_environment()
            or detect.launched_world(resolver) or _world_of_existing_group())


def _world_of_existing_group() -> world_lib.World | None:
    """The `World` of a default process group initialised outside torchstrategy, or None.

    The machine layout comes from LOCAL_RANK / LOCAL_WORLD_SIZE when set, else from the
    replicas' host names, gathered on that group (every replica creates its strategy at
    the same point of the program, as for any collective)."""
    if not dist.is_initialized():
        return None
    rank, size = dist.get_rank(), dist.get_world_size()
    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit() and \
            os.environ.get("LOCAL_RANK", "").isdigit():
        local_rank = int(os.environ["LOCAL_RANK"])
        local_size = int(os.environ["LOCAL_WORLD_SIZE"])
        hosts: list[Any] = []   # not needed: the layout is known
    else:
        hosts = [None] * size
        dist.all_gather_object(hosts, socket.gethostname())
        local_rank = hosts[:rank].count(hosts[rank])
        local_size = hosts.count(hosts[rank])
    machines = list(dict.fromkeys(hosts)) if hosts else None
    return world_lib.World(
        rank=rank, world_size=size, local_rank=local_rank, local_world_size=local_size,
        launcher="adopted", master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(os.environ.get("MASTER_PORT", "0") or 0),
        node_rank=machines.index(hosts[rank]) if machines else rank // max(1, local_size),
        num_nodes=len(machines) if machines else max(1, size // max(1, local_size)))
