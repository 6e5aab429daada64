"""`ts.launch`: run a function as N replicas in fresh processes (notebooks, tests)."""
from __future__ import annotations

import datetime
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
import multiprocessing
import multiprocessing.util
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Mapping, Sequence, cast

import torch


from torchstrategy import _compat, runtime
from torchstrategy.launch import reexec
from torchstrategy.launch import world as world_lib

_TERMINATE_GRACE_SECONDS = 5.0
# How long replicas that returned are given to end by themselves.
_EXIT_GRACE_SECONDS = 10.0


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a replica process (attached as __cause__)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class ReplicaFailed(RuntimeError):
    """A replica process died without reporting an exception (killed, os._exit, crash)."""


class _Terminated(BaseException):
    """SIGTERM reached the launcher: unwinds `launch` so that its clean-up runs."""


def _raise_terminated(signum: int, frame: Any) -> None:
    del frame
    raise _Terminated(signum)


def _in_this_process_only(handler: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
    """`handler`, run only in the process that installs it.

    A process forked from the launcher (a replica started with ``start_method="fork"``, a
    notebook's Lightning replica, any ``os.fork``) inherits the launcher's SIGTERM handler,
    and with it the launcher's clean-up: it would remove the launcher's multiprocessing
    directory, where the fork server's socket lives, and every later `launch` of the
    launcher would then fail to reach its server ("No such file or directory"). Such a
    process ends as SIGTERM ends a process by default instead, and removes nothing."""
    owner = os.getpid()

    def guarded(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        handler(signum, frame)

    return guarded


def _catch_sigterm() -> Any:
    """Makes SIGTERM unwind `launch` (instead of ending the process where it stands, which
    leaves the replicas to notice alone and the /tmp/pymp-* directory behind). Returns the
    handler to put back, or None where it is left alone: outside the main thread, or when
    the program installed its own handler."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _in_this_process_only(_raise_terminated))


def _die_of_sigterm(temp_dir: str | None) -> None:
    """After the replicas are stopped: removes the multiprocessing directory (the normal
    exit that would remove it does not come) and ends this process by SIGTERM, as it would
    have ended without `_catch_sigterm`, so its parent sees the same exit status."""
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _clean_up_at_sigterm(temp_dir: str) -> None:
    """After `launch` returned: the fork server lives on (the next launch reuses it) with
    its socket in `temp_dir` (``/tmp/pymp-*/listener-*``), which only a normal exit
    removes. A SIGTERM to this process while it does something else (idles, trains alone)
    then stops the server and removes the directory before the process ends by SIGTERM as
    usual. Installed only where SIGTERM has the default action (a handler of the program's
    own, later ones included, is left alone)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def clean_up(signum: int, frame: Any) -> None:
        del signum, frame
        _compat.stop_forkserver()
        _die_of_sigterm(temp_dir)

    signal.signal(signal.SIGTERM, _in_this_process_only(clean_up))


def _replica_main(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                  rank: int, num_replicas: int, port: int, timeout: float,
                  conn: connection.Connection, launcher_pid: int,
                  launcher_temp_dir: str | None) -> None:
    # A killed ts.launch leaves no replica behind, nor its /tmp/pymp-* directory.
    reexec.die_with_parent(launcher_pid, launcher_temp_dir)

    def interrupted_while_blocked() -> None:
        # SIGINT to this replica alone, while it waits in a collective: reported now (the
        # launcher then stops every replica), not at the collective's timeout.
        message = (f"ts.launch: replica {rank} was interrupted (SIGINT) while blocked in a "
                   "collective; every replica was stopped.")
        try:
            conn.send_bytes(pickle.dumps(("error", rank, (
                "KeyboardInterrupt", message, message, pickle.dumps(KeyboardInterrupt(message))))))
        finally:
            os._exit(128 + signal.SIGINT)

    reexec.on_blocked_interrupt(interrupted_while_blocked)
    os.environ.update(world_lib.replica_environment(rank, num_replicas, port, "launch",
                                                    timeout))
    torch.set_num_threads(world_lib.threads_per_replica(num_replicas))
    try:
        result = fn(*args, **kwargs)
        try:
            conn.send_bytes(pickle.dumps(("ok", rank, result)))
        except Exception as error:  # the result could not be pickled
            raise TypeError(f"ts.launch: replica {rank}'s return value could not be sent "
                            f"back ({error}); return picklable values.") from error
        # A replica that still waits in a collective with this one can then say why.
        runtime.current().announce_finished()
    except BaseException as error:  # report everything, KeyboardInterrupt included
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        if isinstance(error, SystemExit):
            # Not re-raised in the launcher: SystemExit(0) there would end the launching
            # program with status 0 and no message, reporting a job that did not finish
            # as a success.
            name, message, payload = "SystemExit", _early_exit_message(rank, fn, error), None
        else:
            name, message = type(error).__name__, str(error)
            try:
                payload = pickle.dumps(error)
            except Exception:
                payload = None
        # The other replicas, failing in a collective with this one, name it and its error.
        _leave_note(rank, _how_it_ended(error))
        try:
            conn.send_bytes(pickle.dumps(("error", rank, (name, message, text, payload))))
        finally:
            sys.stderr.flush()
            os._exit(1)
    finally:
        runtime.current().release_process_group()
    conn.close()


def _how_it_ended(error: BaseException) -> str:
    """One line for the other replicas' errors: "called sys.exit(3)", "raised KeyError:
    'x'"."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r})"
    if isinstance(error, KeyboardInterrupt):
        return "was interrupted (Ctrl-C)"
    text = str(error).strip()
    return f"raised {type(error).__name__}" + (f": {text.splitlines()[0][:200]}" if text else "")


def _early_exit_message(rank: int, fn: Callable[..., Any], error: SystemExit) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    return (f"ts.launch: replica {rank} ended early: it called sys.exit({error.code!r}) "
            f"inside {name}() instead of returning, so the other replicas lost it in the "
            "middle of their work and the job did not finish. A replica that ends before its "
            "function returns is a failure, whatever its exit code. Return from the function "
            "instead (every replica after the same number of steps), or raise an exception "
            "to stop the job.")


def _leave_note(rank: int, how: str) -> None:
    """Writes how this replica ended in the rendezvous store (`world_lib.ENDED_KEY`),
    bounded to a few seconds; nothing without a store."""
    store = runtime.current().rendezvous_store()
    if store is None:
        return
    try:
        store.set_timeout(datetime.timedelta(seconds=3))
        store.set(world_lib.ENDED_KEY.format(rank), how)
    except (RuntimeError, OSError):  # the store's host is gone: nobody left to tell
        pass


def _check_picklable(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
                     ) -> None:
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as error:
        raise TypeError(
            f"ts.launch needs a picklable function and arguments ({error}). Define the "
            "function at module level (not a lambda or a nested function) and, in a script, "
            "call ts.launch under `if __name__ == '__main__':`.") from None


def _terminate(processes: Sequence[BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(_TERMINATE_GRACE_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()


def _raise_replica_error(rank: int, info: tuple[str, str, str, bytes | None]) -> None:
    name, message, text, payload = info
    error = None
    if payload is not None:
        try:
            error = pickle.loads(payload)
        except Exception:
            error = None
    remote = RemoteTraceback(f"\n\nReplica {rank} raised:\n\n{text}")
    if name == "SystemExit":
        raise ReplicaFailed(message) from remote
    if isinstance(error, BaseException):
        raise error from remote
    raise RuntimeError(f"Replica {rank} raised {name}: {message}") from remote


def launch(fn: Callable[..., Any], *args: Any, num_replicas: int,
           timeout_seconds: float | None = None, start_method: str = "forkserver",
           **kwargs: Any) -> Any:
    """Runs ``fn(*args, **kwargs)`` in `num_replicas` fresh processes, one replica each.

    Inside `fn`, ``ts.MirroredStrategy()`` joins the launched world (replica ids 0..N-1,
    gloo on CPU, NCCL on GPU). Every process group is bounded by `timeout_seconds` (default
    $TORCHSTRATEGY_TIMEOUT_SECONDS or 30 minutes).

    Returns:
      Replica 0's return value (it must be picklable).

    A SIGTERM to the calling process (when the program has no handler of its own for it
    and `launch` runs in the main thread) stops the replicas, removes the multiprocessing
    directory (``/tmp/pymp-*``) and then ends the process by SIGTERM as usual.

    Raises:
      The first exception raised by any replica (its traceback attached as the cause); the
      other replicas are terminated at once. `ReplicaFailed` if a replica died without an
      exception (killed, crashed).
    """
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}.")
    timeout = world_lib.timeout_seconds(timeout_seconds)
    _check_picklable(fn, args, kwargs)
    # typeshed's BaseContext lacks `Process`, which every concrete context has.
    context: Any = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        # The server imports torch once; each replica then forks from it in milliseconds.
        # torch._dynamo is imported by the first optimizer a replica builds (torch's
        # add_param_group imports it on first call, not `import torch.optim`): 1-3 s of CPU
        # per replica, and 0.1 s once preloaded here (measured, 2 replicas, 2 cores).
        context.set_forkserver_preload(["torchstrategy", "torch.optim", "torch._dynamo"])
        # The fork server's socket lives in this process's multiprocessing directory, which
        # is removed at a normal exit only; replicas remove it if this process is killed.
        temp_dir = multiprocessing.util.get_temp_dir()
        # ... and the server itself is ended (and waited for) at exit: it would notice the
        # exit only afterwards and outlive this process by its own teardown.
        runtime.current().on_shutdown("launch.forkserver", _compat.stop_forkserver)
    else:
        temp_dir = None
    # Loopback only: nothing outside this machine can reach the store the replicas trust.
    store = reexec.listening_store("127.0.0.1", num_replicas,
                                   datetime.timedelta(seconds=timeout))
    processes: list[BaseProcess] = []
    readers: dict[connection.Connection, int] = {}
    previous = _catch_sigterm()
    try:
        for rank in range(num_replicas):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_replica_main, name=f"torchstrategy-replica-{rank}",
                args=(fn, args, kwargs, rank, num_replicas, store.port, timeout, writer,
                      os.getpid(), temp_dir))
            process.start()
            writer.close()
            processes.append(process)
            readers[reader] = rank
        result = _collect(processes, readers)
        # Every replica returned: let each end on its own (its process group released, its
        # multiprocessing finalizers run: a semaphore made in it, e.g. by tqdm for
        # torch.compile's progress bar, is unlinked only then) before stragglers are ended.
        deadline = time.monotonic() + _EXIT_GRACE_SECONDS
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        return result
    except _Terminated:
        _terminate(processes)
        _die_of_sigterm(temp_dir)
        raise  # not reached: the signal's default action ends the process
    finally:
        _terminate(processes)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
            if temp_dir is not None:
                _clean_up_at_sigterm(temp_dir)
        del store


def _is_follow_on(info: tuple[str, str, str, bytes | None]) -> bool:
    """Errors that are usually the consequence of another replica failing first."""
    return world_lib.is_follow_on_error(info[0], info[1])


def _root_cause(rank: int, info: tuple[str, str, str, bytes | None],
                pending: dict[connection.Connection, int], grace_seconds: float = 1.0
                ) -> tuple[int, tuple[str, str, str, bytes | None]]:
    """When a replica fails, the others soon fail too inside their collectives. Reads the
    reports arriving within `grace_seconds` and returns the first that is not such a
    follow-on error (else the first one)."""
    reports = [(rank, info)]
    deadline = time.monotonic() + grace_seconds
    while pending and time.monotonic() < deadline:
        for ready in connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic())):
            reader = cast(connection.Connection, ready)  # wait returns what it was given
            other = pending.pop(reader)
            try:
                status, other, payload = pickle.loads(reader.recv_bytes())
            except EOFError:
                continue
            if status == "error":
                reports.append((other, payload))
    for candidate in reports:
        if not _is_follow_on(candidate[1]):
            return candidate
    return reports[0]


def _collect(processes: Sequence[BaseProcess], readers: dict[connection.Connection, int]
             ) -> Any:
    results: dict[int, Any] = {}
    pending = dict(readers)
    sentinels = {p.sentinel: rank for rank, p in enumerate(processes)}
    reported = set()
    while len(results) < len(processes):
        ready = connection.wait(list(pending) + list(sentinels), timeout=0.5)
        for item in ready:
            if item in pending:
                rank = pending.pop(item)
                try:
                    # Plain pickle, not torch's shared-memory reducers: the sender may be gone by
                    # the time the result is read.
                    status, rank, payload = pickle.loads(item.recv_bytes())
                except EOFError:
                    processes[rank].join(_TERMINATE_GRACE_SECONDS)
                    _terminate(processes)
                    code = processes[rank].exitcode
                    raise ReplicaFailed(f"Replica {rank} ended (exit code {code}) without "
                                        "returning a result or reporting an error.") from None
                reported.add(rank)
                if status == "error":
                    rank, payload = _root_cause(rank, payload, pending)
                    _terminate(processes)
                    _raise_replica_error(rank, payload)
                results[rank] = payload
            elif item in sentinels:
                rank = sentinels.pop(item)
                process = processes[rank]
                process.join()
                # Give a just-sent report a moment to be read before judging the exit.
                report = next((r for r, k in pending.items() if k == rank), None)
                if report is not None and report.poll(1.0):
                    continue
                if rank not in reported:
                    _terminate(processes)
                    code = process.exitcode
                    assert code is not None  # joined above
                    if code == -signal.SIGINT:  # Ctrl-C reached the replicas: the user's
                        raise KeyboardInterrupt(f"ts.launch: replica {rank} was interrupted "
                                                "(Ctrl-C); every replica was stopped.")
                    how = (f"was killed by signal {-code}" if code < 0
                           else f"exited with code {code}")
                    raise ReplicaFailed(f"Replica {rank} {how} without reporting an error.")
    return results[0]
