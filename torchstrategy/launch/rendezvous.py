"""Joining a rendezvous store as a client: bounded, and fresh for every torchrun round.

Two things torch's store client does not guarantee, and replicas need:

- a bound on joining: torch's ``TCPStore`` client retries a refused connection until its
  timeout, but once connected it waits for the server's handshake reply without one, so a
  port held by some other program (not a store) blocks the process for good;
- fresh keys after a restart: since torch 2.4 ``torchrun`` shares its own rendezvous store
  with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``) and does not separate the rounds
  of ``--max-restarts``, so a restarted round reads the previous round's addresses (gloo
  "connectFullMesh failed ... Connection refused") and the round after hangs.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import warnings
from typing import Any

import torch.distributed as dist

from torchstrategy.launch.world import World

# How long past the strategy's timeout torch's handshake may take before it is given up.
_GRACE_SECONDS = 2.0


def _wait_until_listening(host: str, port: int, deadline: float) -> bool:
    """Returns once something accepts TCP connections at `host`:`port` (each refused attempt
    is retried), or False at `deadline` (a `time.monotonic()` value)."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            with socket.create_connection((host, port), timeout=min(remaining, 5.0)):
                return True
        except OSError:  # refused, unreachable or timed out: the chief may not be up yet
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def connect(host: str, port: int, world_size: int, timeout: datetime.timedelta
            ) -> dist.TCPStore:
    """A client of the rendezvous store at `host`:`port`, joined within `timeout` (a
    timedelta, plus a few seconds) or an error naming the address.

    Raises:
      TimeoutError: nothing accepted connections there within the timeout, or the program
        listening there did not answer as a rendezvous store (a port held by another
        program).
      RuntimeError: the program listening there closed the connection (not a store).
    """
    seconds = timeout.total_seconds()
    deadline = time.monotonic() + seconds
    # torch's client retries a refused connection on its own, but for up to about twice its
    # timeout: probe first, so that "nothing listens" is told apart and bounded.
    if not _wait_until_listening(host, port, deadline):
        raise TimeoutError(
            f"torchstrategy: nothing accepted connections at {host}:{port} (the rendezvous "
            f"store's address) within {seconds:g} s: start the chief (replica 0) too, and "
            "check its address and port (TF_CONFIG, MASTER_ADDR / MASTER_PORT) and that the "
            "port is open between the machines.")
    outcome: dict[str, Any] = {}

    def join() -> None:
        try:
            outcome["store"] = dist.TCPStore(host, port, world_size, is_master=False,
                                             wait_for_workers=False, timeout=timeout)
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    # torch's handshake waits for the server's reply without a bound, in C++ with the GIL
    # released: a daemon thread makes it, so the caller's wait can end. A thread left
    # blocked holds one socket until the process, which is failing anyway, exits.
    thread = threading.Thread(target=join, name="torchstrategy-store-connect", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()) + _GRACE_SECONDS)
    if "store" in outcome:
        return outcome["store"]
    if "error" in outcome:
        error = outcome["error"]
        raise RuntimeError(
            f"torchstrategy: could not join the rendezvous store at {host}:{port}: "
            f"{str(error).splitlines()[0][:300]}. Check that the address and port are the "
            "chief's (TF_CONFIG, MASTER_ADDR / MASTER_PORT) and that no other program "
            "listens there.") from error
    raise TimeoutError(
        f"torchstrategy: the program listening at {host}:{port} did not answer as a "
        f"rendezvous store within {seconds:g} s: the port is held by another program, or "
        "the address is not the chief's. Check the chief's address and port (TF_CONFIG, "
        "MASTER_ADDR / MASTER_PORT) and that nothing else listens there.")


def shares_torchrun_store() -> bool:
    """True under a torchrun whose workers share the agent's rendezvous store (torch >= 2.4
    unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 was set for torchrun)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def torchrun_store(world: World, timeout: datetime.timedelta) -> dist.Store | None:
    """The store this torchrun worker's process group should use, or None to let torch
    read it from the environment (``init_method="env://"``).

    On one machine, when torchrun shares its store, the keys of each round (torchrun's
    ``TORCHELASTIC_RESTART_COUNT``, the same for every worker of the single agent) live
    under their own prefix, as ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` would give them a
    fresh store. With several machines the agents count restarts separately, so no prefix
    is common to one round: replica 0 warns instead, naming the fix, when torchrun may
    restart the job.
    """
    if not shares_torchrun_store():
        return None
    if world.num_nodes != 1:
        restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
        if world.rank == 0 and restarts.isdigit() and int(restarts) > 0:
            # A warning, not a log record: the library configures no logging, and this one
            # needs the user to act.
            warnings.warn(
                "torchrun restarts this multi-machine job (--max-restarts) with its shared "
                "rendezvous store: a restarted round can then read the previous round's "
                "addresses and fail or hang in set-up, and a machine joining an elastic job "
                "(--nnodes=MIN:MAX) can hang in torchrun's rendezvous. Start torchrun with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment on every machine.",
                RuntimeWarning, stacklevel=2)
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = connect(world.master_addr, world.master_port, world.world_size, timeout)
    return dist.PrefixStore(f"torchstrategy/round_{attempt}/", store)


class BoundedStore(dist.Store):
    """A view of `store` whose every call answers within `seconds` or raises
    RuntimeError, for bookkeeping that must not outlive its purpose (a supervisor's notes
    at exit). torch's client honours its timeout while waiting for keys, but a request to
    a store whose machine became unreachable (its link down) blocks until TCP gives up,
    many minutes later. After one call timed out, every later call raises at once: the
    store is taken for unreachable.

    The calls run on daemon threads: one left blocked holds a socket until the process,
    which is ending anyway, exits.
    """

    def __init__(self, store: dist.Store, seconds: float = 5.0) -> None:
        super().__init__()
        self._store = store
        self._seconds = seconds
        self._unreachable = False

    def _call(self, name: str, *args: Any) -> Any:
        if self._unreachable:
            raise RuntimeError("torchstrategy: the rendezvous store did not answer before")
        outcome: dict[str, Any] = {}

        def call() -> None:
            try:
                outcome["value"] = getattr(self._store, name)(*args)
            except BaseException as error:  # handed to the caller's thread
                outcome["error"] = error

        thread = threading.Thread(target=call, name="torchstrategy-store-call", daemon=True)
        thread.start()
        thread.join(self._seconds)
        if "error" in outcome:
            raise outcome["error"]
        if "value" not in outcome:
            self._unreachable = True
            raise RuntimeError(f"torchstrategy: the rendezvous store did not answer within "
                               f"{self._seconds:g} s (its machine is unreachable)")
        return outcome["value"]

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def add(self, key: str, value: int) -> int:
        return self._call("add", key, value)

    def wait(self, *args: Any) -> None:
        self._call("wait", *args)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._store.set_timeout(timeout)
