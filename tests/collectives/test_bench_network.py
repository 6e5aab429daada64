"""scripts/bench_network.py: its --quick mode runs end to end in a shaped private network
namespace and reports every configuration; it refuses clearly where the tools are missing.
No timing is asserted (the machine is shared); the figures are in docs/gradient_reduction.md."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_network.py"


def _namespace_unavailable():
    """Why a shaped namespace cannot be made here, or None."""
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed"
    probe = subprocess.run(["unshare", "-rn", "sh", "-c",
                            "ip link set lo up && tc qdisc add dev lo root tbf rate 2gbit "
                            "burst 1mb latency 50ms"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot shape a private namespace here: {probe.stderr.strip()}"
    return None


def _run(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_quick_mode_reports_every_configuration_on_a_shaped_link(tmp_path):
    reason = _namespace_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "summary.json"
    done = _run("--quick", "--rate", "2", "--models", "gpt2,matrices:gpt:1x32",
                "--sweep-model", "gpt2", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    # It ran in its own namespace behind a 2 Gbit/s token bucket.
    assert summary["rate_gbit"] == 2.0
    assert "tbf" in summary["qdisc"] and "rate 2Gbit" in summary["qdisc"], summary["qdisc"]
    gpt = summary["models"]["gpt2"]
    assert set(gpt["sync"]) == {"contiguous", "ddp-best", "ddp-fp16", "ours", "ours-bf16",
                                "ours-powersgd4", "ours-int8", "ours-onebit"}
    assert set(gpt["step"]) == set(gpt["sync"]) | {"local", "serial", "copy", "ours-autotuned",
                                                   "local-adamw"}
    for phase in ("sync", "step"):
        for name, row in gpt[phase].items():
            low, median, high = row["ms"]
            assert 0 < low <= median <= high, (phase, name, row)
        # Bytes each replica sent in the last step: bf16 half of the default, the
        # error-feedback compressors fewer still.
        sent = {n: r["mib_sent"] for n, r in gpt[phase].items() if r["mib_sent"] is not None}
        assert sent["ours-bf16"] < 0.51 * sent["ours"]
        assert sent["ours-int8"] < 0.3 * sent["ours"]
        assert sent["ours-powersgd4"] < sent["ours-int8"]
        # 1-bit Adam (past its one warm-up step): a sign an element, a scale per block
        # (about 31x fewer at full size; here each tiny bucket pads its last block).
        assert sent["ours-onebit"] < sent["ours"] / 10   # tiny buckets: padded blocks
    # The autotuner finished its search during warm-up and kept one of its candidates; the
    # sweep timed every candidate again.
    auto = gpt["autotune"]
    assert len(auto["search_step_ms"]) == 5 and all(t > 0 for t in auto["search_step_ms"])
    assert auto["cap_bytes"] > 0
    assert set(gpt["sweep"]["ms"]) == {"1 MiB", "4 MiB", "16 MiB", "64 MiB", "one bucket"}
    targets = summary["targets"]["gpt2"]
    assert set(targets) == {"ours / max(local, contiguous)", "ours / (contiguous + serial)",
                            "ours-powersgd4 / ddp-best",
                            "ours-powersgd4 / ddp-fp16", "ours-bf16 / ddp-fp16",
                            "ours-onebit / ddp-best", "ours-powersgd4 overhead / one copy",
                            "ours-int8 overhead / one copy", "ours-onebit overhead / one copy"}
    assert "targets (step phase" in done.stdout
    # A model of the kernel sweep's matrices (issue 38 item 4): the QKV, projection and MLP
    # matrices of one block of width 32, every configuration in both phases.
    matrices = summary["models"]["matrices:gpt:1x32"]
    assert matrices["tensors"] == 4 and matrices["mib"] == 12 * 32 * 32 * 4 / 2**20
    assert set(matrices["sync"]) == set(gpt["sync"])
    assert set(matrices["step"]) == set(gpt["step"])
    sent = {n: r["mib_sent"] for n, r in matrices["step"].items() if r["mib_sent"] is not None}
    assert sent["ours-powersgd4"] < sent["ours-int8"] < 0.3 * sent["ours"]
    assert "ours-powersgd4 / ddp-best" in summary["targets"]["matrices:gpt:1x32"]


def test_refuses_clearly_without_unshare(tmp_path):
    # A PATH with no unshare, tc or ip: refused before any process starts.
    env = dict(os.environ, PATH=str(tmp_path))
    env.pop("BENCH_NETWORK_SHAPED", None)
    done = _run("--quick", env=env, timeout=120)
    assert done.returncode == 3, done.stderr
    assert "'unshare' is not installed" in done.stderr
    assert "apt-get install util-linux" in done.stderr


def test_a_bad_matrices_shape_is_refused_before_anything_starts():
    done = _run("--models", "gpt2,matrices:3y8", timeout=120)
    assert done.returncode != 0
    assert "bad shape '3y8': expected BLOCKSxWIDTH or gpt:BLOCKSxWIDTH" in done.stderr


def test_bad_rate_is_refused():
    done = _run("--rate", "0", timeout=120)
    assert done.returncode == 2 and "--rate must be a positive number" in done.stderr
    # The shell wrapper refuses it too, before anything starts.
    done = subprocess.run(["bash", str(ROOT / "scripts" / "bench_network.sh"), "0", "--",
                           "true"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "RATE_GBIT must be a positive number" in done.stderr
