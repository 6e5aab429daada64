"""`TerminationConfig` and the watchers that notice a termination notice on this process.

A cluster announces that it is about to take a machine away in one of two ways: a signal
(SIGTERM from Kubernetes, torchrun's agent or a spot-instance shutdown; SIGUSR1 from SLURM's
``--signal=USR1@90``), or a notice the program must ask for (a metadata server). The
`Watcher` here turns either into one `threading.Event` and the time it was first seen; what
to do about it (agree on a step, save, exit) is `preemption.PreemptionCheckpointHandler`'s.
"""
from __future__ import annotations

import logging
import math
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable, Iterable

from torchstrategy import runtime

logger = logging.getLogger("torchstrategy")

# The exit code after a preemption checkpoint (TensorFlow's choice). torchrun restarts a
# worker group on any non-zero exit while --max-restarts allows; SLURM requeues on it with
# `RequeueExit=42` in slurm.conf or an `scontrol requeue` in the batch script.
RESTART_EXIT_CODE = 42

# How often a `termination_watcher_fn` is asked (it must not block).
_POLL_SECONDS = 1.0


class _StderrUnlessConfigured(logging.Handler):
    """Prints the library's warnings to stderr while the program has configured no logging
    (no handler on the root logger, none of its own on the library's loggers); silent once
    it has, so nothing is printed twice.

    The library's logger carries a NullHandler (so `import torchstrategy` configures
    nothing), which also keeps Python's last-resort handler from printing: without this
    handler a preemption, its save and the exit would leave no trace in a plain program's
    output. Writes to the `sys.stderr` of the moment (a redirected one included).
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if _logging_configured(logging.getLogger(record.name)):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # a closed stderr must not break the save
            self.handleError(record)


def _logging_configured(start: logging.Logger) -> bool:
    """True if a record of `start` reaches a handler the program installed."""
    current: logging.Logger | None = start
    while current is not None:
        if any(not isinstance(h, (logging.NullHandler, _StderrUnlessConfigured))
               for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def install_default_log_handler() -> None:
    """Makes the "torchstrategy" logger's warnings visible on stderr in a program that
    configured no logging (once per process; a program that configures logging, before
    or after, gets its own handlers alone). Called when a `PreemptionCheckpointHandler` is
    made, never at import."""
    runtime.current().install_once(
        "torchstrategy.fault_tolerance.stderr_log_handler",
        lambda: logger.addHandler(_StderrUnlessConfigured()))


def exit_for_restart() -> None:
    """The default `exit_fn`: ends the process with `RESTART_EXIT_CODE`."""
    sys.exit(RESTART_EXIT_CODE)


class TerminationConfig:
    """How a `PreemptionCheckpointHandler` learns of a termination and how it exits.

    Args:
      termination_watcher_fn: a function returning True once a termination notice is
        available (asked once a second in a thread; it must not block). None: the notice is
        a signal (`signals`).
      exit_fn: called after the checkpoint is saved. Default: ``sys.exit(42)``
        (`RESTART_EXIT_CODE`), which torchrun restarts and SLURM can requeue on; a cluster
        that recognises another code wants ``lambda: sys.exit(CODE)``.
      grace_period: seconds between the notice and the hard kill. None or 0: save at the
        agreed step and exit at once. A positive value: save at the agreed step, keep
        training while time is left, then save again at a second agreed step and exit,
        leaving three times (two steps + one save) of the grace period unused.
      save_fn: called on every replica at the agreed step instead of the handler writing the
        checkpoint's objects (with the arguments given to `save_checkpoint_if_preempted`);
        for state the handler cannot write alone, e.g. sharded with
        torch.distributed.checkpoint. Restoring that state is then yours; the handler still
        records `total_run_calls`.
      signals: the signals that announce termination when no `termination_watcher_fn` is
        given (default: SIGTERM); e.g. ``(signal.SIGUSR1, signal.SIGTERM)`` under SLURM.
        Given together with a `termination_watcher_fn`, both are watched.

    Raises:
      TypeError / ValueError: naming the argument, for a function that is not callable, a
        negative or non-finite grace period, or something that is not a signal.
    """

    def __init__(self, termination_watcher_fn: Callable[[], bool] | None = None,
                 exit_fn: Callable[[], Any] | None = None, grace_period: float | None = None,
                 save_fn: Callable[..., Any] | None = None, *,
                 signals: int | Iterable[int] | None = None) -> None:
        for name, fn in (("termination_watcher_fn", termination_watcher_fn),
                         ("exit_fn", exit_fn), ("save_fn", save_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"TerminationConfig: {name} must be callable or None, got "
                                f"{fn!r}.")
        if grace_period is not None:
            valid = not isinstance(grace_period, bool) and isinstance(grace_period, (int, float))
            if not valid or not math.isfinite(grace_period) or grace_period < 0:
                raise ValueError(f"TerminationConfig: grace_period must be a number of seconds "
                                 f">= 0 (or None), got {grace_period!r}.")
        watched: tuple[Any, ...] | None = None
        if signals is not None:
            watched = tuple(signals) if isinstance(signals, (list, tuple, set)) else (signals,)
            valid_signals = set(signal.valid_signals())
            for sig in watched:
                if isinstance(sig, bool) or not isinstance(sig, int) or sig not in valid_signals \
                        or sig in (signal.SIGKILL, signal.SIGSTOP):
                    raise ValueError(f"TerminationConfig: signals must be catchable signals such "
                                     f"as signal.SIGTERM or signal.SIGUSR1, got {sig!r}.")
            if not watched:
                raise ValueError("TerminationConfig: signals=() watches nothing; leave it None "
                                 "for SIGTERM or name the signals.")
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn
        self.grace_period = grace_period
        self.save_fn = save_fn
        self.signals = watched

    def watched_signals(self) -> tuple[signal.Signals, ...]:
        """The signals to catch: `signals`, else SIGTERM unless a watcher function is given."""
        if self.signals is not None:
            return tuple(signal.Signals(s) for s in self.signals)
        return () if self.termination_watcher_fn is not None else (signal.SIGTERM,)

    def __repr__(self) -> str:
        return (f"TerminationConfig(termination_watcher_fn={self.termination_watcher_fn!r}, "
                f"exit_fn={self.exit_fn!r}, grace_period={self.grace_period!r}, "
                f"save_fn={self.save_fn!r}, signals={self.signals!r})")


class Watcher:
    """Sets `notice` (and `notice_time`, monotonic) the first time a termination notice
    arrives: a watched signal, or the watcher function returning True.

    Signal handlers do nothing but record: the training thread acts on the notice at its
    next step, so a signal arriving while a checkpoint is written never interrupts the
    write. `stop()` puts the previous signal handlers back and ends the polling thread.
    """

    def __init__(self, config: TerminationConfig) -> None:
        self.notice = threading.Event()
        self.notice_time: float | None = None
        self.signals_received = 0
        self._config = config
        self._previous: dict[signal.Signals, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def watching(self) -> bool:
        """True between `start` and `stop`."""
        return bool(self._previous) or self._thread is not None

    def start(self) -> None:
        """Installs the signal handlers and starts polling (idempotent).

        Raises:
          ValueError: signals are to be watched but this is not the main thread (Python
            installs signal handlers only there).
        """
        if self.watching:
            return
        watched = self._config.watched_signals()
        if watched and threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "PreemptionCheckpointHandler watches signals, which Python can only do from "
                "the main thread; create it there, or pass a TerminationConfig("
                "termination_watcher_fn=...) that polls for the notice instead.")
        for sig in watched:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if self._config.termination_watcher_fn is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll, daemon=True,
                                            name="torchstrategy-termination-watcher")
            self._thread.start()

    def stop(self) -> None:
        """Restores the signal handlers found at `start` and stops polling (idempotent)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        if self._thread is not None:
            self._stop.set()
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=2 * _POLL_SECONDS)
            self._thread = None

    def _record(self, what: str) -> None:
        if not self.notice.is_set():
            self.notice_time = time.monotonic()
            self.notice.set()
            logger.warning(f"torchstrategy: termination notice ({what}); a checkpoint will be "
                           "saved at a step all replicas agree on.")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.signals_received += 1
        self._record(signal.Signals(signum).name)

    def _poll(self) -> None:
        fn = self._config.termination_watcher_fn
        while fn is not None and not self._stop.wait(_POLL_SECONDS):
            try:
                if fn():
                    self._record("termination_watcher_fn")
                    return
            except Exception as error:  # a flaky notice source must not kill the thread
                logger.warning(f"torchstrategy: termination_watcher_fn raised {error!r}; "
                               "asking again in a second.")
