"""Applying docs/porting_from_ddp.md's diffs to the fixture programs, and running programs
under torchrun, for tests/porting/test_guide_diffs.py and test_real_programs.py.

The guide's diffs are ordinary unified diffs (``--- a/PATH``, ``+++ b/PATH``, ``@@`` hunks):
PATH is a file of this repository (``tests/porting/programs/...``), or, for the DDP
tutorial, `UPSTREAM_TUTORIAL` in a pytorch/examples checkout (test_upstream_tutorial.py). They are applied strictly: every hunk must start at
its stated line, its context and removed lines must match the file exactly, and its line
counts must match its header, so a guide that drifts from the programs fails its test.
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

PROGRAMS = Path(__file__).resolve().parent
REPOSITORY = PROGRAMS.parents[2]
GUIDE = REPOSITORY / "docs" / "porting_from_ddp.md"
# The guide's first diff is against this file of pytorch/examples, as published.
UPSTREAM_TUTORIAL = "distributed/ddp-tutorial-series/multigpu_torchrun.py"
RUN_TIMEOUT_SECONDS = 300
# What a kept torchrun imports before its first launch: what each replica would import
# (torchstrategy, whose import has no side effects; torch._dynamo, which torch.optim loads
# at the first optimizer).
PRELOAD = ("torch._dynamo", "torchstrategy")
# The variables torchrun sets: a test process must not hand its own to the launched world.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_DIFF_BLOCK = re.compile(r"^```diff\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass
class Hunk:
    old_start: int
    old_count: int
    new_count: int
    lines: list[str]          # each with its leading ' ', '-' or '+'


@dataclass
class FileDiff:
    name: str
    hunks: list[Hunk]


def guide_diffs(text: str | None = None) -> list[FileDiff]:
    """Every ```diff block of the guide (or of `text`), parsed. A block that is not a
    unified diff of one file (no ``--- a/`` header, a malformed hunk) is an error."""
    text = GUIDE.read_text() if text is None else text
    return [parse_diff(block) for block in _DIFF_BLOCK.findall(text)]


def parse_diff(block: str) -> FileDiff:
    """One file's unified diff, with hunk line counts checked against their headers."""
    lines = block.splitlines()
    if len(lines) < 3 or not lines[0].startswith("--- a/") or not lines[1].startswith("+++ b/"):
        raise ValueError(f"a diff block must start with '--- a/NAME' and '+++ b/NAME': {lines[:2]}")
    name = lines[0].removeprefix("--- a/")
    if lines[1].removeprefix("+++ b/") != name:
        raise ValueError(f"a diff block must change one file: {lines[:2]}")
    hunks: list[Hunk] = []
    for line in lines[2:]:
        header = _HUNK_HEADER.match(line)
        if header:
            old_start, old_count, _, new_count = header.groups()
            hunks.append(Hunk(int(old_start), int(old_count or 1), int(new_count or 1), []))
        elif hunks and line[:1] in (" ", "-", "+"):
            hunks[-1].lines.append(line)
        elif hunks and line == "":      # an empty context line whose space was trimmed
            hunks[-1].lines.append(" ")
        else:
            raise ValueError(f"{name}: not a line of a unified diff: {line!r}")
    for hunk in hunks:
        old = sum(1 for line in hunk.lines if line[0] in " -")
        new = sum(1 for line in hunk.lines if line[0] in " +")
        if (old, new) != (hunk.old_count, hunk.new_count):
            raise ValueError(f"{name}: hunk at line {hunk.old_start} has {old} old and {new} new "
                             f"lines, its header says {hunk.old_count} and {hunk.new_count}")
    return FileDiff(name, hunks)


def apply_diff(original: str, diff: FileDiff) -> str:
    """`original` with `diff` applied; a ValueError naming the first line that differs
    from the diff's context or removed lines, or a hunk out of order."""
    source = original.splitlines()
    result: list[str] = []
    position = 0                         # lines of `source` consumed so far
    for hunk in diff.hunks:
        start = hunk.old_start - 1 if hunk.old_count else hunk.old_start
        if start < position:
            raise ValueError(f"{diff.name}: hunk at line {hunk.old_start} overlaps the previous one")
        result.extend(source[position:start])
        position = start
        for line in hunk.lines:
            mark, text = line[0], line[1:]
            if mark == "+":
                result.append(text)
                continue
            if position >= len(source) or source[position] != text:
                found = source[position] if position < len(source) else "<end of file>"
                raise ValueError(f"{diff.name}:{position + 1}: the diff expects {text!r}, "
                                 f"the program has {found!r}")
            if mark == " ":
                result.append(text)
            position += 1
    result.extend(source[position:])
    return "\n".join(result) + "\n"


def ported_program(name: str, directory: Path) -> Path:
    """The program `name` of this repository (its path from the repository's root) with the
    guide's diff for it applied, written into `directory` under its file name."""
    (diff,) = [d for d in guide_diffs() if d.name == name]
    path = directory / Path(name).name
    path.write_text(apply_diff((REPOSITORY / name).read_text(), diff))
    return path


# What libstdc++ prints when a thread-owning C++ object (gloo's) dies during interpreter
# teardown: plain torch.distributed programs end so about once in 30 launches, after their
# work (torch.distributed.nn.functional keeps the default group in its defaults past
# destroy_process_group; see docs/troubleshooting.md). torchstrategy's runtime frees the
# group before teardown; torch's own DDP/FSDP2 programs cannot.
TORCH_EXIT_ABORT = "terminate called without an active exception"


def _aborted_at_exit_only(returncode: int, per_rank: dict[int, Path]) -> bool:
    """True when the run failed only because a replica aborted with `TORCH_EXIT_ABORT`
    (SIGABRT) and torchrun then stopped the others (SIGTERM): every aborting replica says
    so on stderr. What it wrote is still checked by the caller, so an abort before the end
    of the work fails there."""
    aborted = [rank for rank, log in per_rank.items()
               if TORCH_EXIT_ABORT in (log / "stderr.log").read_text()]
    return returncode != 0 and bool(aborted)


class KeptTorchrun:
    """One torchrun kept running (torchrun_agent.py) for several launches, one at a time:
    it imported torch and `preload` once, and forks each launch's replicas from itself, so
    a launch costs neither an interpreter start nor an import of torch. Each replica runs
    its program as ``python PROGRAM`` would and ends through its exit handlers
    (forked_replica.py). Started on first use; `close` ends it (a module-scoped fixture's
    teardown)."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD):
        self._preload = preload
        self._process: subprocess.Popen[str] | None = None
        descriptor, name = tempfile.mkstemp(prefix="kept-torchrun-", suffix=".log")
        os.close(descriptor)
        self._log = Path(name)      # what the kept torchrun prints (it appends)

    def launch(self, torchrun_arguments: list[str], cwd: Path, env: dict[str, str],
               timeout: float) -> tuple[int, str]:
        """Runs torchrun with `torchrun_arguments` in `cwd` and `env`; its exit code, and
        what torchrun printed meanwhile. Past `timeout` seconds, the kept torchrun and its
        replicas are killed and the exit code is -9."""
        if self._process is None or self._process.poll() is not None:
            with self._log.open("ab") as log:
                self._process = subprocess.Popen(
                    [sys.executable, str(PROGRAMS / "torchrun_agent.py"),
                     ",".join(self._preload)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                    env=env, start_new_session=True)
        assert self._process.stdin is not None and self._process.stdout is not None
        start = self._log.stat().st_size
        request = {"cwd": str(cwd), "env": env,
                   "argv": ["--run-path", "--start-method=fork", *torchrun_arguments]}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        ready, _, _ = select.select([self._process.stdout], [], [], timeout)
        answer = self._process.stdout.readline() if ready else ""
        output = self._log.read_bytes()[start:].decode(errors="replace")
        if answer.startswith("exited "):
            return int(answer.split()[1]), output
        self.close(kill=True)
        why = f"killed: the launch had not ended after {timeout} s" if not ready else \
            "the kept torchrun ended without answering"
        return -9, f"{output}\n({why})"

    def close(self, kill: bool = False) -> None:
        """Ends the kept torchrun (at once with `kill`: it and every replica it forked)."""
        process, self._process = self._process, None
        if process is None:
            self._log.unlink(missing_ok=True)
            return
        if kill:
            os.killpg(process.pid, signal.SIGKILL)
        else:
            assert process.stdin is not None
            process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if not kill:
            self._log.unlink(missing_ok=True)


def torchrun(program: Path, *args: str, cwd: Path, nproc: int = 2,
             reference: bool = False, kept: KeptTorchrun | None = None) -> str:
    """Runs `program` as torchrun does (``--standalone``: a free port, so tests may run in
    parallel) with `nproc` processes on this machine, in `cwd`; returns what the processes
    printed, each process's whole stdout in rank order (torchrun redirects them to files,
    so the lines of two processes never cut each other). A failure is an AssertionError
    carrying every process's output.

    `kept`: the launch is made by that kept torchrun, its replicas forked from it (torchrun's
    ``--run-path --start-method=fork``); without it, by a new torchrun whose replicas are
    fresh interpreters, as a user's plain ``torchrun`` starts them.

    `reference`: `program` is a plain torch original (DDP, FSDP2) run only to compare
    against: torch's own abort at interpreter exit (`TORCH_EXIT_ABORT`) is then reported
    on stderr and tolerated, since its outputs are compared whole afterwards. A port (the
    library's code) gets no such allowance."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"     # the replicas share the machine's cores
    logs = Path(tempfile.mkdtemp(prefix="torchrun-logs-", dir=cwd))
    options = ["--standalone", f"--nproc-per-node={nproc}", f"--log-dir={logs}", "--redirects=3"]
    if kept is not None:
        returncode, launcher_output = kept.launch(
            [*options, str(PROGRAMS / "forked_replica.py"), str(program), *args], cwd, env,
            RUN_TIMEOUT_SECONDS)
    else:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *options,
                               str(program), *args],
                              cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_SECONDS)
        returncode, launcher_output = done.returncode, done.stdout + done.stderr
    per_rank = {int(path.parent.name): path.parent for path in logs.rglob("stdout.log")}
    outputs = [(per_rank[rank] / "stdout.log").read_text() for rank in sorted(per_rank)]
    if reference and len(outputs) == nproc and _aborted_at_exit_only(returncode, per_rank):
        print(f"{program.name}: torch's abort at exit in the reference run "
              f"({TORCH_EXIT_ABORT!r}); its outputs are compared as usual", file=sys.stderr)
        return "".join(outputs)
    if returncode != 0 or len(outputs) != nproc:
        errors = "".join(f"-- rank {rank} --\n{(per_rank[rank] / 'stdout.log').read_text()}"
                         f"{(per_rank[rank] / 'stderr.log').read_text()[-4000:]}"
                         for rank in sorted(per_rank))
        raise AssertionError(f"{program.name} {' '.join(args)} failed (exit code {returncode})"
                             f":\n{errors}\n-- torchrun --\n{launcher_output[-3000:]}")
    return "".join(outputs)


def without_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """`state` with `prefix` removed from its keys (``module.``, ``_orig_mod.``)."""
    return {key.removeprefix(prefix): value for key, value in state.items()}


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                     what: str) -> None:
    """Same keys in the same order, and every tensor equal bit for bit."""
    assert list(got) == list(want), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0,
                                   msg=lambda m: f"{what} {key}: {m}")
