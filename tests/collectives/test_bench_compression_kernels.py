"""scripts/bench_compression_kernels.py: its --quick mode measures every mode on every shape
of its sweep and writes them; the shapes it sweeps are the parameter sets it names. No
timing is asserted (the machine is shared); the figures are in docs/gradient_reduction.md."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_compression_kernels as bench  # noqa: E402


def test_quick_run_reports_every_mode_on_every_shape(tmp_path):
    out = tmp_path / "kernels.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_compression_kernels.py"),
                           "--quick", "--json", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["threads"] == 1 and report["replicas"] == 2
    assert [r["shape"] for r in report["results"]] == bench.QUICK_SHAPES.split(",")
    for r in report["results"]:
        assert r["bytes"] == 4 * sum(rows * cols for rows, cols in bench.parse_shape(r["shape"]))
        assert r["copy_ms"] > 0
        assert set(r["modes"]) == set(bench.MODES)
        for mode in r["modes"].values():
            low, high = mode["quartiles"]
            assert low <= mode["copies"] <= high
    assert "Issue 38's bound: 6" in done.stdout


def test_shapes_are_the_parameter_sets_named():
    assert bench.parse_shape("3x64") == [(64, 64)] * 3
    assert bench.parse_shape("gpt:2x8") == [(24, 8), (8, 8), (32, 8), (8, 32)] * 2
    for bad in ("16", "ax8", "0x64", "gpt:1x4"):
        with pytest.raises(SystemExit, match="bad shape"):
            bench.parse_shape(bad)
