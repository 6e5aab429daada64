"""Applying docs/porting_from_ddp.md's diffs to the fixture programs, and running programs
under torchrun, for tests/porting/test_guide_diffs.py and test_real_programs.py.

The guide's diffs are ordinary unified diffs (``--- a/PATH``, ``+++ b/PATH``, ``@@`` hunks):
PATH is a file of this repository (``tests/porting/programs/...``), or, for the DDP
tutorial, `UPSTREAM_TUTORIAL` in a pytorch/examples checkout (test_upstream_tutorial.py). They are applied strictly: every hunk must start at
its stated line, its context and removed lines must match the file exactly, and its line
counts must match its header, so a guide that drifts from the programs fails its test.
"""
from __future__ import annotations

import os
import re
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


def torchrun(program: Path, *args: str, cwd: Path, nproc: int = 2,
             reference: bool = False) -> str:
    """Runs `program` as torchrun does (``--standalone``: a free port, so tests may run in
    parallel) with `nproc` processes on this machine, in `cwd`; returns what the processes
    printed, each process's whole stdout in rank order (torchrun redirects them to files,
    so the lines of two processes never cut each other). A failure is an AssertionError
    carrying every process's output.

    `reference`: `program` is a plain torch original (DDP, FSDP2) run only to compare
    against: torch's own abort at interpreter exit (`TORCH_EXIT_ABORT`) is then reported
    on stderr and tolerated, since its outputs are compared whole afterwards. A port (the
    library's code) gets no such allowance."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"     # the replicas share the machine's cores
    logs = Path(tempfile.mkdtemp(prefix="torchrun-logs-", dir=cwd))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", f"--log-dir={logs}", "--redirects=3",
               str(program), *args]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_SECONDS)
    per_rank = {int(path.parent.name): path.parent for path in logs.rglob("stdout.log")}
    outputs = [(per_rank[rank] / "stdout.log").read_text() for rank in sorted(per_rank)]
    if reference and len(outputs) == nproc and _aborted_at_exit_only(done.returncode,
                                                                       per_rank):
        print(f"{program.name}: torch's abort at exit in the reference run "
              f"({TORCH_EXIT_ABORT!r}); its outputs are compared as usual", file=sys.stderr)
        return "".join(outputs)
    if done.returncode != 0 or len(outputs) != nproc:
        errors = "".join(f"-- rank {rank} --\n{(per_rank[rank] / 'stdout.log').read_text()}"
                         f"{(per_rank[rank] / 'stderr.log').read_text()[-4000:]}"
                         for rank in sorted(per_rank))
        raise AssertionError(f"{program.name} {' '.join(args)} failed:\n{errors}\n"
                             f"-- torchrun --\n{(done.stdout + done.stderr)[-3000:]}")
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
