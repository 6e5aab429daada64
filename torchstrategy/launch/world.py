"""The world this process belongs to: its rank, the number of replicas, who launched it.

Three launchers are recognised, in this order:

1. ``ts.launch`` and the re-execution launcher set ``TORCHSTRATEGY_LAUNCHER`` together
   with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
   MASTER_PORT), so code that reads those works the same under every launcher.
2. torchrun (torch.distributed.run), recognised by its variables.
3. Otherwise the process is alone: a plain ``python train.py``.

Once a strategy has established its world, `publish_environment` gives this process
torchrun's variables for it whatever launched it (re-execution's replica 0 and a replica
alone included), so DDP-style code that reads them (``int(os.environ["LOCAL_RANK"])``,
``ddp = int(os.environ.get("RANK", -1)) != -1``) agrees on every replica. Variables a
torchstrategy process published for its own world and a child process merely inherited
(same values, another process) describe the parent, not the child: they are not taken
for a launcher's.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Optional

LAUNCHER_ENV = "TORCHSTRATEGY_LAUNCHER"
TIMEOUT_ENV = "TORCHSTRATEGY_TIMEOUT_SECONDS"
PARENT_PID_ENV = "TORCHSTRATEGY_PARENT_PID"
DEFAULT_TIMEOUT_SECONDS = 1800.0
# The rendezvous-store key by which replica N tells the others that its program ended
# without an uncaught exception (`Runtime.announce_finished`; read by the roll call after a
# failed collective, and by re-execution's supervisor).
FINISHED_KEY = "torchstrategy/finished/{}"
# The key under which how replica N ended, when it failed, is written in one line ("raised
# KeyError: 'x'", "exited with code 3"): by the replica itself (an uncaught exception) or by
# the launcher that saw its exit code; read by the roll call, so that the other replicas'
# errors name it. `ENDS_RECORDED_KEY` is set when a launcher records exit codes (the roll
# call then waits a moment for the note of a replica that ended).
ENDED_KEY = "torchstrategy/ended/{}"
ENDS_RECORDED_KEY = "torchstrategy/ends-recorded"
# Errors a replica gets when another replica failed first: torch's distributed errors, and
# gloo's text for a peer whose end of the connection closed (it ended, or was killed).
FOLLOW_ON_ERRORS = ("CollectiveError", "DistBackendError", "DistNetworkError", "DistError")
PEER_CLOSED_TEXTS = ("Connection closed by peer", "Connection reset by peer")


def is_follow_on_error(name: str, message: str) -> bool:
    """Whether an error named `name` (its class's name) with `message` is usually the
    consequence of another replica failing first, rather than a cause of its own."""
    return name in FOLLOW_ON_ERRORS or is_peer_closed_error(message)


def is_peer_closed_error(message: str) -> bool:
    """Whether `message` says that the replica at the other end of a connection closed it:
    that replica is ending (or ended), so its exit code is about to be known."""
    return any(text in message for text in PEER_CLOSED_TEXTS)
# torchrun's variables that describe a worker's place in the world (torch's
# torch.distributed.elastic agent sets them all; the ROLE_ ones equal the global ones with
# the single role torchrun knows).
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")
# "<pid> <the values>" of the variables `publish_environment` wrote in process <pid>.
PUBLISHED_ENV = "TORCHSTRATEGY_PUBLISHED_WORLD"
# The launchers whose world torchstrategy itself established: their variables are ours to
# write (any such variables already present were inherited or written by us, see
# `from_environment`); under any other launcher only missing variables are added.
OWN_LAUNCHERS = ("single", "reexec", "launch")


@dataclasses.dataclass
class World:
    """This process's place among the replicas.

    Attributes:
      rank: global replica id of this process.
      world_size: number of processes (one replica each).
      local_rank / local_world_size: the same on this machine.
      launcher: "single", "torchrun", "reexec" or "launch".
      master_addr / master_port: the rendezvous store's address.
      store: the rendezvous TCPStore when this process hosts it (re-execution's replica 0).
      node_rank / num_nodes: this machine's index among the machines, and their number.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "single"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    store: Optional[Any] = None
    node_rank: int = 0
    num_nodes: int = 1


def _int_env(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"Environment variable {name} is missing.")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"Environment variable {name}={value!r} is not an integer.") from None


def torchrun_environment(world: World) -> dict[str, str]:
    """torchrun's variables (`TORCHRUN_VARIABLES`) describing `world`, meaning what torchrun
    gives them: global rank and count, rank and count on this machine, this machine's index
    (GROUP_RANK) and the number of machines, and the rendezvous store's address. MASTER_ADDR
    and MASTER_PORT are left out when the world has no store address (port 0)."""
    env = {"RANK": str(world.rank), "LOCAL_RANK": str(world.local_rank),
           "WORLD_SIZE": str(world.world_size),
           "LOCAL_WORLD_SIZE": str(world.local_world_size),
           "GROUP_RANK": str(world.node_rank), "GROUP_WORLD_SIZE": str(world.num_nodes),
           "ROLE_RANK": str(world.rank), "ROLE_WORLD_SIZE": str(world.world_size)}
    if world.master_port:
        env.update(MASTER_ADDR=world.master_addr, MASTER_PORT=str(world.master_port))
    return env


def _published_values(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return " ".join(f"{name}={env.get(name, '')}"
                    for name in (LAUNCHER_ENV,) + TORCHRUN_VARIABLES)


def publish_environment(world: World) -> None:
    """Gives this process torchrun's variables for `world` (`torchrun_environment`).

    Under a launcher torchstrategy itself runs (`OWN_LAUNCHERS`: one replica alone,
    re-execution, ``ts.launch``) they are written, replacing stale inherited ones; under
    any other (torchrun, srun, an adopted group) only the missing ones are added, never
    replacing a launcher's value.
    """
    ours = world.launcher in OWN_LAUNCHERS
    for name, value in torchrun_environment(world).items():
        if ours or name not in os.environ:
            os.environ[name] = value
    if ours:
        os.environ[PUBLISHED_ENV] = f"{os.getpid()} {_published_values()}"


def published_by_torchstrategy(environ: Mapping[str, str]) -> bool:
    """True when torchrun's variables in `environ` are exactly those `publish_environment`
    wrote (in this process or a parent): they describe a world torchstrategy established,
    not a cluster manager's."""
    _, _, values = environ.get(PUBLISHED_ENV, "").partition(" ")
    return bool(values) and values == _published_values(environ)


def without_published(environ: Mapping[str, str]) -> Mapping[str, str]:
    """`environ` without torchrun's variables where torchstrategy published them (for
    cluster detection: they would read as a torchrun or Kubeflow job of one machine);
    `environ` itself otherwise."""
    if not published_by_torchstrategy(environ):
        return environ
    return {k: v for k, v in environ.items() if k not in TORCHRUN_VARIABLES}


def inherited_from_parent() -> bool:
    """True when torchrun's variables here are exactly those a torchstrategy process
    published for its own world, and this is another process (its child, a fork): they
    describe the parent's world, not a launcher's for this process."""
    pid = os.environ.get(PUBLISHED_ENV, "").partition(" ")[0]
    return published_by_torchstrategy(os.environ) and pid.isdigit() and \
        int(pid) != os.getpid()


def under_torchrun() -> bool:
    """True when torchrun (or another launcher setting its variables) started this process."""
    if inherited_from_parent():
        return False
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return True
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def from_environment() -> World | None:
    """The `World` described by the environment, or None for a plain process."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is None and not under_torchrun() or inherited_from_parent():
        return None
    world_size = _int_env("WORLD_SIZE")
    local_world_size = _int_env("LOCAL_WORLD_SIZE", world_size)
    rank = _int_env("RANK")
    local_rank = _int_env("LOCAL_RANK", rank)
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE={world_size} in the environment: the number of replicas "
                         "must be at least 1. Fix the launcher's variables (or unset them to "
                         "run one process).")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world_size} in the environment: RANK "
                         f"must be 0..{world_size - 1}. Fix the launcher's variables, or unset "
                         "RANK and WORLD_SIZE to run one process.")
    if not 1 <= local_world_size <= world_size or not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} with LOCAL_WORLD_SIZE={local_world_size} "
                         f"(WORLD_SIZE={world_size}) in the environment: LOCAL_RANK must be "
                         "0..LOCAL_WORLD_SIZE-1 and LOCAL_WORLD_SIZE at most WORLD_SIZE. Fix the "
                         "launcher's variables.")
    return World(rank=rank, world_size=world_size,
                 local_rank=local_rank,
                 local_world_size=local_world_size,
                 launcher=launcher or "torchrun",
                 master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                 master_port=_int_env("MASTER_PORT", 0),
                 node_rank=_int_env("GROUP_RANK", rank // max(1, local_world_size)),
                 num_nodes=_int_env("GROUP_WORLD_SIZE",
                                    max(1, world_size // max(1, local_world_size))))


def timeout_seconds(explicit: float | None = None) -> float:
    """The collective timeout: `explicit`, else $TORCHSTRATEGY_TIMEOUT_SECONDS, else 30 min."""
    raw: float | str
    if explicit is not None:
        name, raw = "timeout_seconds", explicit
        fix = "pass a positive, finite number of seconds, e.g. timeout_seconds=600"
    else:
        name, raw = TIMEOUT_ENV, os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_SECONDS)
        fix = f"set {TIMEOUT_ENV} to a positive, finite number of seconds, e.g. 600, or unset it"
    try:
        value = None if isinstance(raw, bool) else float(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"The timeout must be a positive, finite number of seconds, got "
                         f"{name}={raw!r}: {fix}.")
    return value


def replica_environment(rank: int, world_size: int, port: int, launcher: str, timeout: float,
                        *, node_rank: int = 0, num_nodes: int = 1,
                        master_addr: str = "127.0.0.1") -> dict[str, str]:
    """The environment variables a launched replica receives (torchrun's names plus ours).

    With several machines (`num_nodes` > 1) `rank` is the global rank; each machine runs
    ``world_size // num_nodes`` replicas, machine `node_rank` holding the consecutive ranks
    from ``node_rank * world_size // num_nodes``.
    """
    local_world_size = world_size // num_nodes
    env = torchrun_environment(World(
        rank=rank, world_size=world_size, local_rank=rank - node_rank * local_world_size,
        local_world_size=local_world_size, launcher=launcher, master_addr=master_addr,
        master_port=port, node_rank=node_rank, num_nodes=num_nodes))
    env.update({LAUNCHER_ENV: launcher, TIMEOUT_ENV: repr(float(timeout)),
                PARENT_PID_ENV: str(os.getpid())})
    return env


def threads_per_replica(local_world_size: int) -> int:
    """Intra-op threads for each of `local_world_size` CPU processes sharing this machine:
    the cores divided between them, so replicas do not oversubscribe the CPU."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))
