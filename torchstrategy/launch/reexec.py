"""Re-execution launcher: a plain ``python train.py`` becomes N local replicas.

The original process is replica 0. It starts replicas 1..N-1 by running the same command
again (same interpreter, flags, script or module, and arguments) with torchrun's variables
set, then supervises them:

- one replica failing ends all: the others are terminated and the job exits with the
  failing replica's exit code;
- replica 0 failing (an exception, Ctrl-C) terminates the others before it exits;
- children never outlive replica 0 (PR_SET_PDEATHSIG on Linux, and a watchdog thread).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
import _thread
import datetime
from types import TracebackType
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchstrategy.launch import network, rendezvous
from torchstrategy.launch import world as world_lib


_POLL_SECONDS = 0.1
_TERMINATE_GRACE_SECONDS = 5.0
# How long replica 0 waits at exit for the others before it releases its end of the process
# group, so that a replica still blocked in a collective with it fails instead of hanging.
_EXIT_WAIT_BEFORE_RELEASE_SECONDS = 30.0
# How long replica 0 is left to fail on its own (in a collective with a replica that ended)
# before the supervisor interrupts it.
_MAIN_FAILS_ALONE_SECONDS = 3.0
# How long the main thread has to take a SIGINT before it is deemed blocked outside Python.
_INTERRUPT_GRACE_SECONDS = 2.0
# How long replica 0's exit waits for the supervisor's watch to finish recording how the
# replicas ended: its store calls are bounded at `rendezvous.BoundedStore`'s 5 s (and after
# one timed out, the others fail at once).
_WATCH_END_SECONDS = 10.0
# How long replica 0, failed in a collective, waits for another replica to fail first:
# `_NAMING_GRACE_SECONDS` in general; `_PEER_CLOSED_GRACE_SECONDS` when its error says a
# peer closed its connection, since that replica is then certainly ending, but may still be
# running its exit handlers (a logger's upload, the interpreter's teardown: seconds on a
# loaded machine) after its connections closed. A replica that announced its end or wrote
# its exception in the store is then waited for `_ENDING_GRACE_SECONDS` more, for its code.
_NAMING_GRACE_SECONDS = 1.0
_PEER_CLOSED_GRACE_SECONDS = 30.0
_ENDING_GRACE_SECONDS = 10.0


def reexec_command() -> list[str]:
    """The command that re-runs this program, or raises if it cannot be re-run.

    Raises:
      RuntimeError: in notebooks, interactive sessions, ``python -`` and under pytest, naming
        `ts.launch` and torchrun as the ways to run several replicas there.
    """
    hint = ("Run it under torchrun (`torchrun --nproc-per-node=N train.py`), or start the "
            "replicas with ts.launch(fn, num_replicas=N).")
    argv = list(getattr(sys, "orig_argv", []))
    interactive = hasattr(sys, "ps1") or "ipykernel" in sys.modules or sys.flags.interactive
    if interactive or not sys.argv or sys.argv[0] in ("", "-"):
        raise RuntimeError("A multi-replica strategy cannot re-execute an interactive "
                           f"session or a notebook for its other replicas. {hint}")
    if "pytest" in sys.modules and os.path.basename(sys.argv[0]).startswith(("pytest", "py.test")
                                                                          ) or (
            "pytest" in sys.modules and "-m" in argv and "pytest" in argv):
        raise RuntimeError(f"A multi-replica strategy cannot re-execute pytest. {hint}")
    if not argv:
        raise RuntimeError(f"Cannot tell how this program was started. {hint}")
    return [sys.executable] + argv[1:]


def set_parent_death_signal() -> None:
    """This process gets SIGKILL when its parent dies (Linux's PR_SET_PDEATHSIG; nothing
    elsewhere). Used as a ``preexec_fn``: re-executed replicas die with replica 0, local
    parameter-server tasks with their chief."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def die_with_parent(launcher_pid: int, launcher_temp_dir: str | None = None) -> None:
    """In a replica started by `launcher_pid` (`ts.launch`): end this process when the
    launcher dies, SIGTERM and SIGKILL included. `launcher_temp_dir`: the launcher's
    multiprocessing directory (``/tmp/pymp-*``, the fork server's socket), which a killed
    launcher cannot remove: the replica that sees the launcher gone removes it.

    PR_SET_PDEATHSIG covers a replica that is the launcher's child (start methods "spawn" and
    "fork"); under "forkserver" the parent is the fork server, which outlives the launcher
    while replicas hold its liveness pipe, so a thread also watches the launcher itself. A
    launcher that died before this ran (the race PR_SET_PDEATHSIG leaves) ends us now.
    """
    set_parent_death_signal()
    started = _start_time(launcher_pid)
    if started is None:
        os._exit(1)

    def watch() -> None:
        while _start_time(launcher_pid) == started:  # a reused pid has another start time
            time.sleep(0.5)
        if launcher_temp_dir is not None:
            shutil.rmtree(launcher_temp_dir, ignore_errors=True)  # replicas may race here
        os._exit(1)

    threading.Thread(target=watch, name="torchstrategy-launcher-watch", daemon=True).start()


def _start_time(pid: int) -> str | None:
    """When process `pid` started (an opaque token), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except FileNotFoundError:
        return None
    except (OSError, IndexError):  # no /proc here: whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "alive"


def listening_store(host: str, world_size: int, timeout: datetime.timedelta, port: int = 0
                    ) -> dist.TCPStore:
    """The master `TCPStore` of a rendezvous, listening on `host` only (never every
    interface): the socket is bound here and handed to the store, which owns its descriptor
    from then on. `host` "127.0.0.1" for one machine; the configured chief address for
    several. If that address is not one of this machine's (a NAT or service address), the
    store listens on every interface, with a warning.

    Raises:
      OSError: the port is taken, naming the address.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
    except socket.gaierror:
        address = (host, port)
    if host != "localhost" and address[0] != host and network.is_loopback(str(address[0])):
        # A machine's own name mapped to loopback (Debian's 127.0.1.1): the other machines
        # resolve it to the machine's address, so the store must listen there too.
        address = ("::" if family == socket.AF_INET6 else "0.0.0.0", port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as error:
            if error.errno != 99:  # EADDRNOTAVAIL: not an address of this machine
                raise OSError(error.errno, f"The rendezvous store cannot listen on "
                              f"{host}:{port}: {error.strerror}.") from None
            # A warning, not a log record: the library configures no logging, and the user
            # must act on this one.
            warnings.warn(f"{host} is not an address of this machine; the rendezvous store "
                          f"listens on port {port} of every interface. Make sure only the "
                          "cluster's machines can reach it.", RuntimeWarning, stacklevel=2)
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        sock.listen(512)
        store = dist.TCPStore(host, sock.getsockname()[1], world_size, is_master=True,
                              wait_for_workers=False, timeout=timeout,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the descriptor when it is destroyed
    return store


def watch_parent() -> None:
    """In a re-executed replica: exit if replica 0 has gone (portable fallback); and an
    uncaught exception is written in the rendezvous store (`note_uncaught_exceptions`)."""
    parent = os.environ.get(world_lib.PARENT_PID_ENV)
    if parent is None:
        return
    note_uncaught_exceptions()
    # Ctrl-C while blocked in a collective: exit as interrupted; the supervisor stops all.
    on_blocked_interrupt(lambda: os._exit(128 + signal.SIGINT))

    def watch() -> None:
        while True:
            if os.getppid() != int(parent):
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="torchstrategy-parent-watch", daemon=True).start()


def exit_when_interrupted_while_blocked(rank: int) -> None:
    """Under torchrun: a SIGINT (Ctrl-C to the job, ``kill -INT`` to a worker) that this
    replica's main thread cannot take because it is blocked in a collective ends this
    process at once (exit status 130) instead of at the collective's timeout; torchrun's
    agent then stops the other workers, as for any failed worker. A replica that can take
    the signal raises KeyboardInterrupt as usual."""
    def interrupted() -> None:
        print(f"torchstrategy: replica {rank} was interrupted (SIGINT) while blocked in a "
              "collective; exiting so that torchrun stops every replica.",
              file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGINT)

    on_blocked_interrupt(interrupted)


def on_blocked_interrupt(action: Callable[[], None],
                         grace_seconds: float = _INTERRUPT_GRACE_SECONDS) -> None:
    """Calls `action()` from a watcher thread when SIGINT (Ctrl-C, ``kill -INT``) reached
    this process and its main thread did not take it within `grace_seconds`: it is blocked
    outside Python (in a collective waiting for another replica), where the
    KeyboardInterrupt would be raised only when the call returns, at the collective's
    timeout. `action` ends that wait (stops the peers, or ends this process).

    Python's own handling is kept: the handler installed here notes that the signal was
    taken, then raises KeyboardInterrupt as Python's default does. Nothing is installed
    outside the main thread, where the program has a SIGINT handler of its own, or where a
    wakeup descriptor is set already (an event loop's)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    if signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False) != -1:
        signal.set_wakeup_fd(-1)
        os.close(read_fd)
        os.close(write_fd)
        return
    taken = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        taken.set()
        signal.default_int_handler(signum, frame)   # raises KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)

    def watch() -> None:
        while True:
            try:
                received = os.read(read_fd, 64)   # the numbers of the signals caught
            except OSError:
                return
            if signal.SIGINT in received:
                if not taken.wait(grace_seconds) and \
                        signal.getsignal(signal.SIGINT) is handler:
                    action()
                taken.clear()

    threading.Thread(target=watch, name="torchstrategy-interrupt-watch",
                     daemon=True).start()


def note_uncaught_exceptions() -> None:
    """In a re-executed replica: an uncaught exception is written, in one line, under
    `world_lib.ENDED_KEY` in the rendezvous store (MASTER_ADDR:MASTER_PORT), before the
    process exits, so that the other replicas' errors and replica 0's report name it
    rather than the closed connection it leaves them with."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException,
             tb: TracebackType | None) -> None:
        previous(kind, value, tb)   # the traceback first, as always
        if not issubclass(kind, KeyboardInterrupt):
            text = str(value).strip()
            write_end_note(int(os.environ.get("RANK", "0")), f"raised {kind.__name__}" +
                           (f": {text.splitlines()[0][:200]}" if text else ""))

    sys.excepthook = hook


def write_end_note(rank: int, how: str, store: dist.Store | None = None) -> None:
    """Writes how replica `rank` ended under `world_lib.ENDED_KEY` in `store` (default: a
    client of the store at MASTER_ADDR:MASTER_PORT); bounded to a few seconds, and
    silent if the store is gone (nobody is left to tell)."""
    try:
        if store is None:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=datetime.timedelta(seconds=3))
        else:
            store.set_timeout(datetime.timedelta(seconds=3))
        store.set(world_lib.ENDED_KEY.format(rank), how)
    except (RuntimeError, OSError, KeyError, ValueError):
        pass


def _how_code_ended(code: int) -> str:
    """An exit code in words, as `world_lib.ENDED_KEY` holds it ("" for 0)."""
    if code == 0:
        return ""
    if _interrupted(code):
        return "was interrupted (Ctrl-C)"
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class Supervisor:
    """Replica 0's watch over the replicas it started (owned by the runtime, which calls
    `at_exit` from its single exit handler)."""

    def __init__(self, children: dict[int, subprocess.Popen[bytes]],
                 store: dist.Store | None = None) -> None:
        self.children = children  # rank -> Popen
        self.store = store        # the rendezvous store (replicas announce their end there)
        # (rank, exit code) of the first replica that failed
        self.failure: tuple[int, int] | None = None
        self.main_failed = False
        self.main_lost_a_peer = False  # replica 0's error: a peer closed its connection
        self.interrupted = False  # Ctrl-C (SIGINT): the user's, not a replica's failure
        self.stopping = False     # we are terminating the replicas: their deaths are ours
        self.exiting = False      # replica 0's main thread is in its exit handler
        self.lock = threading.Lock()
        self.ended: set[int] = set()  # ranks whose end is written in the store
        if store is not None:
            # The roll call of a replica that waited for one that ended then waits a
            # moment for its exit code (`_record_end`).
            try:
                store.set(world_lib.ENDS_RECORDED_KEY, "1")
            except (RuntimeError, OSError):
                pass
        self._watcher = threading.Thread(target=self.watch, name="torchstrategy-supervisor",
                                         daemon=True)
        self._watcher.start()
        on_blocked_interrupt(self._interrupted_while_blocked)

    def _interrupted_while_blocked(self) -> None:
        """SIGINT reached replica 0 while it is blocked in a collective: the other replicas
        are stopped, which ends that collective, and the KeyboardInterrupt is raised."""
        with self.lock:
            self.interrupted = True
        print("torchstrategy: replica 0 was interrupted (Ctrl-C) while blocked in a "
              "collective; stopping every replica.", file=sys.stderr, flush=True)
        self.terminate_all()

    def install_excepthook(self) -> None:
        """Notes an uncaught exception in replica 0, so that `at_exit` reports the replica
        whose death caused it rather than the symptom."""
        previous = sys.excepthook

        def hook(kind: type[BaseException], value: BaseException,
                 tb: TracebackType | None) -> None:
            self.main_failed = True
            self.main_lost_a_peer = world_lib.is_peer_closed_error(str(value))
            if issubclass(kind, KeyboardInterrupt):
                self.interrupted = True
            previous(kind, value, tb)

        sys.excepthook = hook

    def terminate_all(self) -> None:
        """Terminates every replica still running (killed after a grace period)."""
        self.stopping = True
        for child in self.children.values():
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + _TERMINATE_GRACE_SECONDS
        for child in self.children.values():
            remaining = max(0.0, deadline - time.monotonic())
            try:
                child.wait(remaining)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def watch(self) -> None:
        """Polls the replicas until they end; the first failure or Ctrl-C stops them all."""
        while True:
            running = False
            for rank, child in self.children.items():
                code = child.poll()
                if code is None:
                    running = True
                    continue
                if self.stopping:  # replica 0 is ending the job: not a failure
                    return
                self._record_end(rank, code)
                if _interrupted(code):
                    self._on_interrupt(rank)
                    return
                elif code != 0:
                    self._on_failure(rank, code)
                    return
            if not running:
                return
            time.sleep(_POLL_SECONDS)

    def _record_end(self, rank: int, code: int) -> None:
        """Writes how replica `rank` ended (its exit code in words) in the store, once,
        unless the replica wrote its uncaught exception there itself."""
        if rank in self.ended or self.store is None:
            return
        self.ended.add(rank)
        try:
            if self.store.check([world_lib.ENDED_KEY.format(rank)]):
                return
        except (RuntimeError, OSError):
            return
        how = _how_code_ended(code)
        try:
            if code > 0 and self.store.check([world_lib.FINISHED_KEY.format(rank)]):
                # It announced a normal end at exit: no exception, a SystemExit's code.
                how = f"called sys.exit({code})"
        except (RuntimeError, OSError):
            pass
        write_end_note(rank, how, self.store)

    def _how_it_ended(self, rank: int, code: int) -> str:
        """"exited with code 1 (it raised KeyError: 'x')": the exit code, and the
        exception the replica wrote in the store, if any."""
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        note = self._end_note(rank)
        return f"{how} (it {note})" if note.startswith(("raised", "called")) else how

    def _end_note(self, rank: int) -> str:
        """How replica `rank` ended, as written in the store (`world_lib.ENDED_KEY`);
        "" if nothing is written or the store is unusable."""
        if self.store is None:
            return ""
        key = world_lib.ENDED_KEY.format(rank)
        try:
            return self.store.get(key).decode(errors="replace") \
                if self.store.check([key]) else ""
        except (RuntimeError, OSError):
            return ""

    def _on_failure(self, rank: int, code: int) -> None:
        with self.lock:
            if self.failure is not None:
                return
            self.failure = (rank, code)
        print(f"torchstrategy: replica {rank} {self._how_it_ended(rank, code)}; stopping all "
              "replicas.", file=sys.stderr, flush=True)
        self.terminate_all()
        # Replica 0 is usually failing already in a collective with that replica, its
        # roll call reading how the replica ended (`_record_end`): it is given a moment to
        # raise that error itself before it is interrupted.
        deadline = time.monotonic() + _MAIN_FAILS_ALONE_SECONDS
        while not (self.exiting or self.main_failed) and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS / 2)
        if not (self.exiting or self.main_failed):
            _thread.interrupt_main()
        time.sleep(_TERMINATE_GRACE_SECONDS * 2)
        # The main thread did not stop (blocked outside Python): end the process.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_code())

    def _on_interrupt(self, rank: int) -> None:
        """A replica ended by Ctrl-C (a terminal sends SIGINT to every process of the job):
        the user's interruption, reported as such; replica 0 gets KeyboardInterrupt."""
        with self.lock:
            if self.failure is not None or self.interrupted:
                return
            self.interrupted = True
        print(f"torchstrategy: replica {rank} was interrupted (Ctrl-C); stopping all "
              "replicas.", file=sys.stderr, flush=True)
        self.terminate_all()
        if not self.exiting:
            _thread.interrupt_main()

    def exit_code(self) -> int:
        """The job's exit code: the first failed replica's (128 + N when signal N killed
        it)."""
        if self.failure is None:
            raise RuntimeError("Supervisor.exit_code: no replica has failed.")
        rank, code = self.failure
        return code if code > 0 else 128 - code

    def _wait_for_ending_children(self, deadline: float) -> None:
        """Replica 0 failed, often because a replica ended first (its program returned or
        called sys.exit, or it raised) while replica 0 waited in a collective with it: such
        a replica announced its end or wrote its exception in the store and is on its way
        out, so its exit code is waited for (until `deadline`, a `time.monotonic()`) and,
        if it is not 0, becomes the job's."""
        for rank in self._ending_children():
            try:
                code = self.children[rank].wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
            if code != 0 and not _interrupted(code):
                with self.lock:
                    self.failure = self.failure or (rank, code)
                return

    def _ending_children(self) -> list[int]:
        """The replicas still running that announced their end or wrote their exception
        in the store: they are on their way out."""
        if self.store is None:
            return []
        try:
            return [rank for rank, child in self.children.items() if child.poll() is None
                    and (self.store.check([world_lib.FINISHED_KEY.format(rank)]) or
                         self.store.check([world_lib.ENDED_KEY.format(rank)]))]
        except (RuntimeError, OSError):  # the store is unusable: nothing more to learn
            return []

    def _failed_child(self) -> tuple[int, int] | None:
        """(rank, exit code) of a replica that failed, not counting one interrupted by
        Ctrl-C or terminated by us."""
        if self.stopping:
            return None
        for rank, child in self.children.items():
            code = child.poll()
            if code not in (None, 0) and not _interrupted(code):
                return rank, code
        return None

    def at_exit(self, release_process_group: Callable[[], None]) -> None:
        """Waits for the other replicas, then calls `release_process_group` (after at most
        ``_EXIT_WAIT_BEFORE_RELEASE_SECONDS`` even if they still run, so that one blocked in a
        collective with us fails instead of hanging); exits with the code of the replica
        that failed first, if any."""
        self.exiting = True
        if self.main_failed:
            # Replica 0's error is often the symptom ("connection closed by peer") of
            # another replica dying first: report and exit with that replica's code. When
            # the error says so, that replica's exit is waited for until it comes (bounded),
            # not for a fixed moment: its connections close before its exit handlers end.
            start = time.monotonic()
            grace = _PEER_CLOSED_GRACE_SECONDS if self.main_lost_a_peer else _NAMING_GRACE_SECONDS
            while self.failure is None and time.monotonic() < start + grace:
                failed = self._failed_child()
                if failed is not None:
                    with self.lock:
                        self.failure = self.failure or failed
                elif self.main_lost_a_peer and (
                        any(child.poll() is not None for child in self.children.values())
                        or self._ending_children()):
                    break   # a replica ended, not in failure, or is on its way out
                time.sleep(_POLL_SECONDS / 2)
            if self.failure is None:
                self._wait_for_ending_children(time.monotonic() + _ENDING_GRACE_SECONDS)
            self.terminate_all()
            if self.failure is not None:
                self._exit_with_failure()
            self._exit_naming_a_stopped_replica_that_raised()
            self._wait_for_watch()
            if self.interrupted:
                # Python ends the process as interrupted (SIGINT; exit status 130 in a shell).
                print("torchstrategy: interrupted (Ctrl-C); every replica was stopped.",
                      file=sys.stderr, flush=True)
            return
        released = False
        start = time.monotonic()
        try:
            while any(child.poll() is None for child in self.children.values()):
                if self.failure is not None:
                    break
                if not released and \
                        time.monotonic() - start > _EXIT_WAIT_BEFORE_RELEASE_SECONDS:
                    released = True
                    release_process_group()
                time.sleep(_POLL_SECONDS)
        except KeyboardInterrupt:
            self.terminate_all()
        if not released:
            release_process_group()
        if self.failure is None:
            for rank, child in self.children.items():
                if child.returncode not in (0, None):
                    self.failure = (rank, child.returncode)
                    break
        if self.failure is not None:
            self._exit_with_failure()
        self._wait_for_watch()

    def _wait_for_watch(self) -> None:
        """Waits (at most `_WATCH_END_SECONDS`) until the watch thread has ended, having
        recorded how every replica ended.

        Replica 0's interpreter must not finalize while that daemon thread is inside a
        store call: torch's bindings release the GIL during the call, and a daemon thread
        that takes the GIL back during finalization is ended by pthread_exit (Python 3.11),
        whose unwinding through the bindings' noexcept frames calls std::terminate. The
        job, whose replicas all succeeded, would then end in SIGABRT ("terminate called
        without an active exception"), at random and more often on a loaded machine."""
        if self._watcher is not threading.current_thread():
            self._watcher.join(_WATCH_END_SECONDS)

    def _exit_with_failure(self) -> None:
        if self.failure is None:
            return
        rank, code = self.failure
        self._record_end(rank, code)  # if the watch thread has not yet
        follows = (" Replica 0's error above follows from it: fix that replica's."
                   if self.main_failed else "")
        print(f"torchstrategy: replica {rank} {self._how_it_ended(rank, code)}; the job exits "
              f"with its code.{follows}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(self.exit_code())

    def _exit_naming_a_stopped_replica_that_raised(self) -> None:
        """Replica 0 failed, and no other replica's exit code told why: one that wrote in
        the store that it raised an exception, but was still running its exit handlers
        when it was stopped, is the cause. It is named with its exception, and the job
        exits with 1, the code of an uncaught exception. Returns if there is none."""
        if self.interrupted:
            return
        for rank in sorted(self.children):
            note = self._end_note(rank)
            if note.startswith("raised"):
                print(f"torchstrategy: replica {rank} {note}, and was still exiting when the "
                      "job stopped it; the job exits with code 1. Replica 0's error above "
                      "follows from it: fix that replica's.", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(1)


def _interrupted(code: int) -> bool:
    """Whether a replica's exit code says Ctrl-C ended it (killed by SIGINT, or the 130
    that shells and some programs use for it)."""
    return code in (-signal.SIGINT, 128 + signal.SIGINT)


def start_local_replicas(num_replicas: int, timeout_seconds: float, *, node_rank: int = 0,
                         num_nodes: int = 1, master_addr: str | None = None,
                         master_port: int | None = None
                         ) -> tuple[world_lib.World, Supervisor | None]:
    """Starts replicas 1..N-1 of this program; returns replica 0's `World` and the
    `Supervisor` watching them (None when nothing was started). Call it through
    ``torchstrategy.runtime.current().start_local_replicas``, which owns both.

    On one machine this process hosts the rendezvous store on 127.0.0.1 and a port the OS
    picks, so there is no port to configure and no race for one.

    On several machines (a TF_CONFIG cluster) this is machine `node_rank` of `num_nodes`,
    each running `num_replicas` replicas: machine 0's first process hosts the store at
    `master_addr`:`master_port` and every other process connects to it; machine m's
    replicas take the global ranks ``m * num_replicas .. (m + 1) * num_replicas - 1``.
    With one replica per machine nothing is re-executed.
    """
    world_size = num_replicas * num_nodes
    timeout = datetime.timedelta(seconds=timeout_seconds)
    command = reexec_command() if num_replicas > 1 else []
    store: dist.TCPStore
    if num_nodes == 1:
        master_addr = "127.0.0.1"
        store = listening_store(master_addr, world_size, timeout)
    elif master_addr is None or master_port is None:
        raise ValueError(f"Replicas on {num_nodes} machines need the chief's address: pass "
                         f"master_addr and master_port (got {master_addr!r}, {master_port!r}).")
    elif node_rank == 0:
        store = listening_store(master_addr, world_size, timeout, port=master_port)
    else:
        store = rendezvous.connect(master_addr, master_port, world_size, timeout)
    first_rank = node_rank * num_replicas
    threads = world_lib.threads_per_replica(num_replicas)
    children: dict[int, subprocess.Popen[bytes]] = {}
    for local_rank in range(1, num_replicas):
        rank = first_rank + local_rank
        env = dict(os.environ)
        env.update(world_lib.replica_environment(rank, world_size, store.port, "reexec",
                                                 timeout_seconds, node_rank=node_rank,
                                                 num_nodes=num_nodes, master_addr=master_addr))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        children[rank] = subprocess.Popen(command, env=env, preexec_fn=set_parent_death_signal)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads)
    # Bounded: at exit, the store of an unreachable chief must not hold this machine.
    supervisor = Supervisor(children, rendezvous.BoundedStore(store)) if children else None
    return world_lib.World(rank=first_rank, world_size=world_size, local_rank=0,
                           local_world_size=num_replicas, launcher="reexec",
                           master_addr=master_addr, master_port=store.port, store=store,
                           node_rank=node_rank, num_nodes=num_nodes), supervisor
