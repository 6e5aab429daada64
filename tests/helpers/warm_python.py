"""Running many short Python scripts, each as ``python script.py`` would, without paying the
imports of torch and torchstrategy for each one.

`WarmPython` starts one interpreter (this file run as a program) that imports a fixed list of
modules once and then waits. For each script it forks a child, and the child runs the script
as ``__main__``, in its own working directory, with its own output files, as a fresh
``python script.py`` would: ``sys.argv``, ``sys.orig_argv`` (which torchstrategy reads to
re-execute the program for its other replicas), ``sys.path[0]`` and ``__main__`` are the
script's; an uncaught exception prints its traceback and exits 1; ``sys.exit`` gives its code;
at the end non-daemon threads are waited for and atexit callbacks run (the modules are not
freed one by one: see `_exit`). Each script gets a new process: what
one script changes (strategies, ``os.environ``, signal handlers, random seeds) never reaches
the next.

What differs from a fresh interpreter: the preloaded modules are already in ``sys.modules``.
So only modules whose import has no effect a script could rely on are preloaded (never
``torchstrategy.lightning``, whose import registers the Lightning strategy names), and only
modules that the scripts import themselves. The environment is fixed when the interpreter
starts (it is the same for every script), since libraries such as OpenMP read it at import.

The preloading interpreter imports but computes nothing, so it has no threads when it forks
(checked: the fork is refused otherwise).

Protocol (one script at a time): a request is one JSON line on the interpreter's stdin
``{"script", "cwd", "stdout", "stderr"}``; the interpreter answers ``ready`` once its imports
are done, ``started <pid>`` when the child runs and ``exited <code> <cpu seconds>`` when it has
ended (a negative code: killed by that signal; the CPU time of the child and of the processes
it waited for).
"""
import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time

# What every docs page imports anyway (torch, torchstrategy), what torch imports at the first
# optimizer (torch._dynamo), and the heavy libraries some pages import themselves.
PRELOADED_MODULES = ("torch", "torch._dynamo", "torch.optim", "torchstrategy",
                     "sklearn.datasets", "torchmetrics", "lightning.pytorch")


class WarmPython:
    """One preloading interpreter, started on first use and restarted if it died.

    `run` runs one script and returns ``(exit_code, stdout, stderr)``; a script still running
    after `timeout` seconds is killed (SIGKILL) and reported with exit code None. Its CPU
    time is then in `last_cpu_seconds`."""

    def __init__(self, env, modules=PRELOADED_MODULES):
        self._env = dict(env)
        self._modules = tuple(modules)
        self._process = None
        self.last_cpu_seconds = None

    def _start(self):
        self._log = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *self._modules],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=self._env,
            bufsize=0)
        ready = self._read_line(time.monotonic() + 300)
        if ready != "ready":
            raise RuntimeError(f"the preloading interpreter did not get ready ({ready!r}):\n"
                               f"{self._log_tail()}")

    def _log_tail(self):
        self._log.seek(0)
        return self._log.read()[-4000:].decode(errors="replace")

    def _read_line(self, deadline):
        """The interpreter's next answer, or None if none came before `deadline`."""
        assert self._process is not None and self._process.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([self._process.stdout], [], [], remaining)
            if not ready:
                return None
            chunk = self._process.stdout.read(1)
            if not chunk:
                code = self._process.wait()
                raise RuntimeError(f"the preloading interpreter ended (exit code {code}):\n"
                                   f"{self._log_tail()}")
            line += chunk
        return line.decode().strip()

    def start(self):
        """Starts the interpreter and waits for its imports, unless it runs already."""
        if self._process is None or self._process.poll() is not None:
            self._start()

    def run(self, script, cwd, timeout):
        self.start()
        assert self._process is not None and self._process.stdin is not None
        stdout_path = os.path.join(cwd, ".stdout")
        stderr_path = os.path.join(cwd, ".stderr")
        request = {"script": os.path.abspath(script), "cwd": os.path.abspath(cwd),
                   "stdout": stdout_path, "stderr": stderr_path}
        self._process.stdin.write((json.dumps(request) + "\n").encode())
        started = self._read_line(time.monotonic() + 60)
        if started is None or not started.startswith("started "):
            raise RuntimeError("the preloading interpreter did not start the script "
                               f"({started!r}):\n{self._log_tail()}")
        pid = int(started.split()[1])
        exited = self._read_line(time.monotonic() + timeout)
        code = None
        if exited is None:
            os.kill(pid, 9)
            exited = self._read_line(time.monotonic() + 60)   # its "exited -9 ..."
        else:
            code = int(exited.split()[1])
        self.last_cpu_seconds = float(exited.split()[2]) if exited else None
        return code, _read(stdout_path), _read(stderr_path)

    def close(self):
        if self._process is not None and self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()   # end of requests: the interpreter exits
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._process is not None:
            self._log.close()
        self._process = None


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _threads_of_this_process():
    return len(os.listdir("/proc/self/task"))


def _become_script(request):
    """In the forked child: runs the request's script as ``python script`` would, and ends
    this process with the script's exit code. Never returns."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script]
    sys.orig_argv = [sys.executable, script]
    sys.path[0] = os.path.dirname(script)
    main = type(sys)("__main__")
    main.__dict__.update(__file__=script, __builtins__=__builtins__, __cached__=None,
                         __package__=None, __spec__=None)
    sys.modules["__main__"] = main
    try:
        with open(script, "rb") as f:
            code = compile(f.read(), script, "exec")
        exec(code, main.__dict__)
        exit_code = 0
    except SystemExit as exit_request:
        exit_code = _exit_code(exit_request)
    except BaseException:
        sys.excepthook(*sys.exc_info())   # the traceback, as the interpreter prints it
        exit_code = 1
    _exit(exit_code)


def _exit_code(exit_request):
    """The code ``python`` exits with for this SystemExit."""
    if exit_request.code is None:
        return 0
    if isinstance(exit_request.code, int):
        return exit_request.code
    print(exit_request.code, file=sys.stderr)
    return 1


def _exit(exit_code):
    """Ends this process as the interpreter's own exit does, in its order: waits for the
    non-daemon threads (threading's own exit step, which also stops executors' workers), runs
    the atexit callbacks (torchstrategy's runtime shuts down there), flushes stdout and
    stderr. It skips the last step, freeing every module: the preloaded modules make it take
    over 2 s, and Python does not promise finalizers for objects alive at exit anyway."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(exit_code)


def _answer(text):
    os.write(_ANSWERS, (text + "\n").encode())


def _serve(modules):
    for name in modules:
        __import__(name)
    _answer("ready")
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        request = json.loads(line)
        threads = _threads_of_this_process()
        if threads != 1:
            raise RuntimeError(f"the preloading interpreter has {threads} threads: a fork "
                               "would copy their locks in whatever state they are in")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(_ANSWERS)
            _become_script(request)
        _answer(f"started {pid}")
        _, status, usage = os.wait4(pid, 0)
        # CPU seconds of the script and of the processes it started and waited for.
        cpu_seconds = usage.ru_utime + usage.ru_stime
        _answer(f"exited {os.waitstatus_to_exitcode(status)} {cpu_seconds:.2f}")


if __name__ == "__main__":
    # Answers go to a copy of the original stdout; the children write theirs to files.
    _ANSWERS = os.dup(1)
    os.dup2(2, 1)
    _serve(sys.argv[1:])
