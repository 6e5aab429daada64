"""Runs a list of commands, a few at a time, each with its own output files and timeout.

    python tests/lightning/scenario_runner.py JOBS.json PARALLEL

tests/lightning/test_lightning.py starts this once per module, so that its Lightning
launches (each a few seconds of imports per replica) run side by side, and while the
in-process tests run, instead of one after another. It is a separate program, not threads
in pytest, because tests in the pytest process fork replicas: a fork must not copy threads.
It imports neither torch nor Lightning.

JOBS.json is a list of ``{"command": [...], "stdin": path or null, "dir": path,
"timeout": seconds}``. Jobs start in list order, at most PARALLEL at once, each in its own
process group. A job's output goes to DIR/stdout.txt and DIR/stderr.txt; when it has ended,
DIR/seconds holds how long it ran, then DIR/exit_status its exit code (negative: killed by
that signal), or "timeout" where the job ran past its timeout and its process group was
killed. SIGTERM kills the running jobs' process groups and ends the runner (exit code 1);
the runner exits 0 once every job has ended.
"""
import json
import os
import signal
import subprocess
import sys
import time

_POLL_SECONDS = 0.1


def _write_status(directory, status):
    # Written whole, then renamed: a reader never sees a partly written status.
    partial = os.path.join(directory, "exit_status.partial")
    with open(partial, "w") as file:
        file.write(str(status))
    os.replace(partial, os.path.join(directory, "exit_status"))


def _start(job):
    os.makedirs(job["dir"], exist_ok=True)
    with open(os.path.join(job["dir"], "stdout.txt"), "w") as stdout, \
            open(os.path.join(job["dir"], "stderr.txt"), "w") as stderr:
        stdin = open(job["stdin"]) if job.get("stdin") else subprocess.DEVNULL
        try:
            return subprocess.Popen(job["command"], stdin=stdin, stdout=stdout, stderr=stderr,
                                    start_new_session=True)
        finally:
            if stdin is not subprocess.DEVNULL:
                stdin.close()


def _kill_group(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def run(jobs, parallel):
    """Runs `jobs` (see the module docstring) until every one has ended."""
    pending = list(jobs)
    running = {}  # Popen -> (job, start time, deadline)

    def stop(_signum, _frame):
        for process in running:
            _kill_group(process)
        sys.exit(1)

    signal.signal(signal.SIGTERM, stop)
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            started = time.monotonic()
            running[_start(job)] = (job, started, started + job["timeout"])
        time.sleep(_POLL_SECONDS)
        for process, (job, started, deadline) in list(running.items()):
            code = process.poll()
            if code is None and time.monotonic() > deadline:
                _kill_group(process)
                code = "timeout"
            if code is not None:
                # What the job left running (a replica it started) ends with it.
                if code != "timeout":
                    _kill_group(process)
                del running[process]
                with open(os.path.join(job["dir"], "seconds"), "w") as seconds:
                    seconds.write(f"{time.monotonic() - started:.1f}")
                _write_status(job["dir"], code)


if __name__ == "__main__":
    with open(sys.argv[1]) as jobs_file:
        run(json.load(jobs_file), int(sys.argv[2]))
