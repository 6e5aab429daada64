"""The restart marker: how a preempted replica tells a `requeue_exit` wrapper, across the
launchers in between (torchrun), that its exit asks for a restart.

``python -m torchstrategy.launch.requeue_exit -- COMMAND`` sets ``MARKER_VARIABLE`` to a file
of its own; a `PreemptionCheckpointHandler` calls `clear_marker` when it is made (a new
attempt begins) and `write_marker` after its preemption checkpoint is written, just before
its ``exit_fn``. Without the variable both do nothing.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("torchstrategy")

MARKER_VARIABLE = "TORCHSTRATEGY_PREEMPTION_MARKER"


def write_marker(description: str) -> str | None:
    """Records that this process saved a preemption checkpoint and is about to exit for a
    restart: writes `description` to the file named by ``TORCHSTRATEGY_PREEMPTION_MARKER``
    (atomically: several replicas may write it at once). Returns the path, or None when
    the variable is not set (no wrapper asked for it) or the file could not be written
    (logged; the exit goes on)."""
    path = os.environ.get(MARKER_VARIABLE)
    if not path:
        return None
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w") as f:
            f.write(description.rstrip("\n") + "\n")
        os.replace(temporary, path)
    except OSError as error:
        # The exit for the restart must still happen; the wrapper then reports the
        # launcher's own status.
        logger.warning(f"torchstrategy: could not write the restart marker {path} "
                       f"({error.strerror}); a requeue_exit wrapper will report the "
                       "launcher's own exit status.")
        return None
    return path


def clear_marker() -> None:
    """Removes the marker, if any: a new attempt starts (a handler is being made)."""
    path = os.environ.get(MARKER_VARIABLE)
    if path:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
