"""Starting replicas by forking one process that has already imported Lightning.

A Lightning program's replica spends seconds of CPU importing Lightning, torch._dynamo and
scipy (13 s of CPU measured on a loaded 2-core machine). A test program that imports them
once and then forks each replica, with torchrun's variables for its world, pays that import
once for all its worlds. Lightning's strategies and ours find a world from those variables
(as under torchrun) and start nothing.

`run_forked` forks one child per `Forked` and waits for all of them together; each child
runs its function and ends with ``os._exit`` (0, or 1 after printing its traceback), without
the interpreter's finalisation (which would walk every object the imports made) and without
the parent's exit handlers. Each child is a new process: nothing one child does reaches
another, or the parent. The parent must not have started Python threads or run torch ops
before forking (a fork copies one thread; torch's OpenMP pool would not survive it):
`run_forked` refuses when a Python thread other than the main one runs. (The imports do
start native threads, 2 on this 2-core machine: importing numpy alone starts one, its
OpenBLAS pool, which OpenBLAS quiesces and restarts around a fork with pthread_atfork.)
"""
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from tests.helpers.multi_machine import free_port


@dataclass
class Forked:
    """One child: `function(*args)` with `env` added to its environment; `name` in errors."""
    name: str
    function: Callable[..., Any]
    args: tuple = ()
    env: dict = field(default_factory=dict)


def world(name: str, replicas: int, function: Callable[..., Any], *args: Any) -> list[Forked]:
    """The replicas of one world on this machine: torchrun's variables, a fresh port."""
    port = str(free_port())
    return [Forked(f"{name}, replica {rank} of {replicas}", function, args,
                   {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(replicas),
                    "LOCAL_WORLD_SIZE": str(replicas), "GROUP_RANK": "0",
                    "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
            for rank in range(replicas)]


def _child(forked: Forked) -> None:
    code = 1
    try:
        os.environ.update(forked.env)
        forked.function(*forked.args)
        code = 0
    except BaseException:
        print(f"{forked.name}:", file=sys.stderr)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_forked(children: list[Forked], timeout: float) -> list[str]:
    """Forks every child, waits for all (at most `timeout` seconds together, then kills the
    rest); returns what went wrong, one line per child that failed (empty: all exited 0)."""
    threads = threading.enumerate()
    if len(threads) != 1:
        raise RuntimeError(f"run_forked: Python threads {[t.name for t in threads]} run in "
                           "this process; fork before anything starts a thread (or runs a "
                           "torch op).")
    sys.stdout.flush()
    sys.stderr.flush()
    running = {}
    for forked in children:
        pid = os.fork()
        if pid == 0:
            _child(forked)
        running[pid] = forked.name
    deadline = time.monotonic() + timeout
    failures = []
    while running and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        name = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failures.append(f"{name} exited with {code}")
    for pid, name in running.items():
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        failures.append(f"{name} did not end in {timeout:.0f} s (killed)")
    return failures
