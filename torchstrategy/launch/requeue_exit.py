"""``python -m torchstrategy.launch.requeue_exit -- torchrun ...``: a preemption's "restart me"
that survives the launchers in between.

A `PreemptionCheckpointHandler` that saved after a termination notice exits with 42, which
SLURM's ``RequeueExit=42`` or a Kubernetes ``podFailurePolicy`` can act on. A launcher in
between does not pass that code on: torchrun exits 1 once its worker failed and it has no
restarts left (or when it was itself signalled), so the scheduler sees a failure.

This wrapper runs the command with ``TORCHSTRATEGY_PREEMPTION_MARKER`` naming a file in a
private temporary directory. Every replica's handler writes that file after its preemption
checkpoint is written, just before it calls ``exit_fn``, and removes it when a handler
starts (a restart by torchrun within the same command begins a new attempt). When the
command ends with a non-zero status and the file exists, the wrapper exits with
``--exit-code`` (default 42) instead; otherwise with the command's own status (128 + N for
a command killed by signal N, as a shell reports it). It forwards SIGTERM, SIGINT, SIGHUP,
SIGQUIT, SIGUSR1 and SIGUSR2 to the command, so that it can be the first process of a
container, except inside an ``srun`` step (SLURM_STEP_ID set), where slurmstepd signals every
process of the step itself; there it only survives them.

The marker is per wrapper, on the wrapper's machine: run one wrapper per machine (one
``srun`` task per node, torchrun inside), and every machine's wrapper sees its own
replicas' marker.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from types import FrameType
from typing import Sequence

from torchstrategy.launch.restart_marker import MARKER_VARIABLE

DEFAULT_EXIT_CODE = 42
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                     signal.SIGUSR1, signal.SIGUSR2)


def _status(returncode: int) -> int:
    """A Popen return code as a shell reports it (a signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def run(command: Sequence[str], exit_code: int = DEFAULT_EXIT_CODE) -> int:
    """Runs `command` with a fresh marker path in its environment; returns `exit_code` when
    it failed after a preemption save, else its own status.

    Raises:
      ValueError: an empty command, or an exit code outside 1..255.
      FileNotFoundError: the command's program does not exist.
    """
    if not command:
        raise ValueError("requeue_exit: no command given; usage: python -m "
                         "torchstrategy.launch.requeue_exit [--exit-code N] -- torchrun ...")
    if not 0 < exit_code < 256:
        raise ValueError(f"requeue_exit: --exit-code must be in 1..255 (what a process can "
                         f"exit with), got {exit_code}.")
    directory = tempfile.mkdtemp(prefix="torchstrategy-requeue-")
    marker = os.path.join(directory, "preempted")
    try:
        child = subprocess.Popen(list(command), env=dict(os.environ, **{MARKER_VARIABLE: marker}))

        # Inside an srun step, slurmstepd signals every process of the step itself (by
        # process tree or group, whatever its ProctrackType): the command already has the
        # signal, and a second SIGTERM would cut short torchrun's own shutdown of its
        # workers. Elsewhere (the first process of a container) the wrapper alone gets it.
        in_srun_step = bool(os.environ.get("SLURM_STEP_ID"))

        def forward(signum: int, frame: FrameType | None) -> None:
            if not in_srun_step and child.poll() is None:
                child.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
        try:
            returncode = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if returncode != 0 and os.path.exists(marker):
            with open(marker) as f:
                what = f.read().strip()
            print(f"requeue_exit: {' '.join(command[:1])} ended with status "
                  f"{_status(returncode)} after a preemption checkpoint was saved ({what}); "
                  f"exiting with {exit_code} so that the scheduler restarts the job.",
                  file=sys.stderr, flush=True)
            return exit_code
        return _status(returncode)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchstrategy.launch.requeue_exit",
        description="Runs COMMAND; if it fails after a PreemptionCheckpointHandler saved a "
                    "preemption checkpoint, exits with --exit-code (a code the scheduler "
                    "requeues or restarts on) instead of the command's status.")
    parser.add_argument("--exit-code", type=int, default=DEFAULT_EXIT_CODE,
                        help="the status to exit with after a preemption save (default 42; "
                             "e.g. 143 for Kubeflow's restartPolicy: ExitCode)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command, after --: torchrun ... or python train.py")
    args = parser.parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        return run(command, args.exit_code)
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
        return 2  # parser.error exits; this line is for the type checker


if __name__ == "__main__":
    sys.exit(main())
