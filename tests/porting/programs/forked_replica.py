"""A replica forked by a kept torchrun (torchrun_agent.py) runs its program here as
``python PROGRAM ARGS...`` would, and ends as that interpreter would end it.

    (torchrun --run-path) /abs/forked_replica.py /abs/PROGRAM.py ARGS...

The program runs as ``__main__`` with its own ``sys.argv`` and its directory first on
``sys.path``. Then, as at the interpreter's exit, the non-daemon threads are waited for and
the ``atexit`` handlers run (a strategy's shutdown: its announcement that the replica has
finished, the release of its process group), also when the program raised; a forked
replica otherwise ends in ``os._exit`` without them. What differs from a fresh interpreter:
the modules the agent imported are loaded already, and the interpreter's own teardown
(freeing the modules) does not happen.
"""
import atexit
import os
import runpy
import sys
import threading


def _wait_for_non_daemon_threads():
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def main():
    program, *arguments = sys.argv[1:]
    sys.argv = [program, *arguments]
    sys.path.insert(0, os.path.dirname(program))
    try:
        runpy.run_path(program, run_name="__main__")
    finally:
        _wait_for_non_daemon_threads()
        atexit._run_exitfuncs()    # CPython's own exit step (no public name for it)


if __name__ == "__main__":
    main()
