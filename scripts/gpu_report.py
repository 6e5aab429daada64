"""The report of ``scripts/gpu_check.sh``: every part's status, duration, command and the
tail of its output, the test counts, and the benchmarks' figures against their targets,
written as ``report.md`` and ``report.json`` in one directory.

Used by scripts/gpu_check.py (which runs the parts) and by tests/gpu/test_gpu_check.py. Only
the standard library: the report is written even when torch does not import.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import xml.etree.ElementTree as ElementTree
from typing import Any

# A part's status, one of:
PASSED, FAILED, TIMEOUT, SKIPPED = "passed", "failed", "timeout", "skipped"
STATUSES = (PASSED, FAILED, TIMEOUT, SKIPPED)
TAIL_LINES = 40


@dataclasses.dataclass
class Part:
    """One part of the check and what became of it.

    Attributes:
      name: short identifier ("build", "cuda-tests", ...).
      description: what the part proves, one line.
      command: the command line it runs (shown by --dry-run and in the report).
      status: one of STATUSES; None before it ran.
      reason: why it was skipped or failed (one line), else "".
      duration_s: seconds it ran (0 when skipped).
      timeout_s: its own time limit.
      returncode: the command's exit status (None when it did not run).
      tail: the last TAIL_LINES lines of its output (stdout and stderr together).
      tests: {"passed": n, "failed": n, "skipped": n, "errors": n} for a pytest part, plus
        "skip_reasons" ({reason: count}); None for others.
      results: the JSON a benchmark part wrote (see scripts/gpu_bench.py), or None.
    """

    name: str
    description: str
    command: list[str]
    timeout_s: float
    needs_cuda: bool = False
    status: str | None = None
    reason: str = ""
    duration_s: float = 0.0
    returncode: int | None = None
    tail: str = ""
    tests: dict[str, Any] | None = None
    results: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tail_of(text: str, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of `text` (all of it when shorter)."""
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def pytest_counts(junit_xml: str) -> dict[str, Any] | None:
    """Counts of a pytest run from its ``--junitxml`` file: passed, failed, skipped,
    errors, and the skip reasons with their counts. None when the file is missing or not
    JUnit XML (the run died before writing it)."""
    if not os.path.exists(junit_xml):
        return None
    try:
        root = ElementTree.parse(junit_xml).getroot()
    except ElementTree.ParseError:
        return None
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0,
                              "skip_reasons": {}, "failures": []}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag == "skipped":
                outcome = "skipped"
                reason = (child.get("message") or "").strip()
                counts["skip_reasons"][reason] = counts["skip_reasons"].get(reason, 0) + 1
            elif child.tag == "failure":
                outcome = "failed"
            elif child.tag == "error":
                outcome = "errors"
        counts[outcome] += 1
        if outcome in ("failed", "errors"):
            counts["failures"].append(name)
    return counts


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _format_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def target_rows(parts: list[Part]) -> list[dict[str, Any]]:
    """Every figure with a target, from the benchmark parts' results: name, value, target
    (text), met (bool, or None when there is no value)."""
    rows = []
    for part in parts:
        for figure in (part.results or {}).get("figures", []):
            if figure.get("target") is None:
                continue
            rows.append({"part": part.name, **figure})
    return rows


def summary(parts: list[Part]) -> dict[str, Any]:
    """Counts of parts by status, test counts summed, targets met and missed."""
    by_status = {s: [p.name for p in parts if p.status == s] for s in STATUSES}
    tests = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for part in parts:
        for key in tests:
            tests[key] += (part.tests or {}).get(key, 0)
    rows = target_rows(parts)
    return {"parts": by_status, "tests": tests,
            "targets_met": [r["name"] for r in rows if r.get("met") is True],
            "targets_missed": [r["name"] for r in rows if r.get("met") is False],
            "ok": not by_status[FAILED] and not by_status[TIMEOUT]}


def markdown(meta: dict[str, Any], parts: list[Part]) -> str:
    """The report as markdown: the machine, a table of the parts, the benchmarks' figures
    against their targets, then each part's command and output tail."""
    s = summary(parts)
    out = ["# GPU check report", ""]
    out.append(f"- date: {meta.get('date', '?')}")
    out.append(f"- device: {meta.get('device', '?')}")
    out.append(f"- CUDA: {meta.get('cuda_reason', '?')}")
    for key in ("python", "torch", "host", "command", "budget_s", "wall_s"):
        if key in meta:
            out.append(f"- {key}: {meta[key]}")
    out.append(f"- result: {'OK' if s['ok'] else 'FAILURES'}; parts passed "
               f"{len(s['parts'][PASSED])}, failed {len(s['parts'][FAILED])}, timed out "
               f"{len(s['parts'][TIMEOUT])}, skipped {len(s['parts'][SKIPPED])}; tests "
               f"passed {s['tests']['passed']}, failed {s['tests']['failed']}, errors "
               f"{s['tests']['errors']}, skipped {s['tests']['skipped']}")
    out += ["", "## Parts", "", "| part | status | seconds | limit | note |",
            "|---|---|---|---|---|"]
    for p in parts:
        note = p.reason
        if p.tests is not None:
            counted = (f"{p.tests['passed']} passed, {p.tests['failed']} failed, "
                       f"{p.tests['errors']} errors, {p.tests['skipped']} skipped")
            note = f"{counted}; {note}" if note else counted
        out.append(f"| {p.name} | {p.status} | {p.duration_s:.1f} | {p.timeout_s:.0f} | "
                   f"{_cell(note)} |")
    rows = target_rows(parts)
    figures = [(p.name, f) for p in parts for f in (p.results or {}).get("figures", [])]
    if figures:
        out += ["", "## Figures", "", "| part | figure | value | spread | target | met |",
                "|---|---|---|---|---|---|"]
        for name, f in figures:
            met = {True: "yes", False: "**no**", None: ""}[f.get("met")]
            out.append(f"| {name} | {_cell(f['name'])} | {_format_ratio(f.get('value'))} "
                       f"{_cell(f.get('unit', ''))} | {_cell(f.get('spread', ''))} | "
                       f"{_cell(f.get('target') or '')} | {met} |")
        if rows:
            out += ["", f"Targets met: {len(s['targets_met'])}; missed: "
                    f"{', '.join(s['targets_missed']) or 'none'}."]
    skip_reasons: dict[str, int] = {}
    for p in parts:
        for reason, count in ((p.tests or {}).get("skip_reasons") or {}).items():
            skip_reasons[reason] = skip_reasons.get(reason, 0) + count
    if skip_reasons:
        out += ["", "## Skipped tests, by reason", ""]
        out += [f"- {count} x {reason}" for reason, count in sorted(skip_reasons.items())]
    out += ["", "## Each part", ""]
    for p in parts:
        out += [f"### {p.name}: {p.status}", "", p.description, "",
                f"Command (limit {p.timeout_s:.0f} s): `{shlex.join(p.command)}`", ""]
        if p.reason:
            out += [f"Why: {p.reason}", ""]
        if p.tests and p.tests.get("failures"):
            out += ["Failed: " + ", ".join(p.tests["failures"]), ""]
        if p.tail:
            out += ["```", p.tail, "```", ""]
    return "\n".join(out) + "\n"


def write(directory: str, meta: dict[str, Any], parts: list[Part]) -> tuple[str, str]:
    """Writes ``report.md`` and ``report.json`` into `directory` (created); returns their
    paths. The JSON holds `meta`, every part (`Part.to_json`) and `summary`."""
    os.makedirs(directory, exist_ok=True)
    md_path = os.path.join(directory, "report.md")
    json_path = os.path.join(directory, "report.json")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(markdown(meta, parts))
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "parts": [p.to_json() for p in parts],
                   "summary": summary(parts)}, f, indent=1, sort_keys=True)
    return md_path, json_path
