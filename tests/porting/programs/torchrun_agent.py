"""torchrun kept running: one process that imports torch and the programs' libraries once,
then launches one torchrun world after another, each by torchrun's own ``main`` with the
arguments it is given, its replicas forked from this process (``--run-path
--start-method=fork``, torchrun's own options) instead of started as fresh interpreters.

    python torchrun_agent.py MODULE[,MODULE...]

Protocol (harness.KeptTorchrun): one JSON line per launch on stdin, ``{"cwd": DIR, "env":
{...}, "argv": [torchrun's arguments]}``; the launch runs in DIR with exactly that
environment, and its end is answered by one line ``exited CODE`` on stdout (0: every
replica succeeded). Everything else this process or its replicas print goes to stderr.
It stops at the end of stdin, without the interpreter's teardown.

Only modules whose import has no effect a program could rely on are imported first
(torchstrategy's import has none; ``torchstrategy.lightning`` registers names and is never
one of them). What one launch changes in a replica never reaches the next: each replica is
a new process forked from this one, which itself runs only torchrun's agent.
"""
import importlib
import json
import os
import sys
import traceback

from torch.distributed.run import main as torchrun_main


def _launch(request):
    """Runs one torchrun world; its exit code."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    try:
        torchrun_main(request["argv"])
    except SystemExit as end:                 # torchrun's argument errors
        return end.code if isinstance(end.code, int) else int(end.code is not None)
    except Exception:                         # a replica failed (ChildFailedError), or torchrun
        traceback.print_exc()
        return 1
    return 0


def main():
    for name in sys.argv[1].split(","):
        importlib.import_module(name)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())   # stdout carries only the answers
    for line in sys.stdin:
        code = _launch(json.loads(line))
        sys.stderr.flush()
        print(f"exited {code}", file=answers, flush=True)
    # Every launch has ended and its replicas were waited for: nothing is left to release,
    # and the interpreter's teardown of torch would cost seconds.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
