"""MirroredStrategy on a GPU: ``MirroredStrategy()`` picks the GPU and NCCL and trains at
world 1 exactly as a plain loop (deterministic settings, 1e-6); two processes sharing the
device over gloo with CUDA tensors train as one device, the reducer waiting on the busy side
stream that produced the gradients; bf16 autocast, and fp16 with a GradScaler whose
overflowing step (on one replica only) is skipped on every replica; compression (bf16,
Int8, PowerSGD; Int8 and PowerSGD also with overlap=True, compressing on a side stream during
backward) over NCCL equals the same compression over gloo.

Each test runs on "cuda" (skipped without a GPU, saying so) and on "cpu", where the same
code and comparisons run with CPU replicas over gloo (the GPU's facts aside).
"""
import os
import subprocess
import sys

import pytest
import torch

from tests.gpu import cases
from tests.gpu.devices import CUDA_ONLY, DEVICES, needs_cuda
from tests.helpers import ROOT
from tests.helpers.lightning_runs import clean_env
from tests.helpers.replicas import launch

TIMEOUT = 180


def environment(device, **extra):
    env = clean_env()
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""     # the CPU path, also on a machine with a GPU
    env.update(extra)
    return env


def run_case(device, *args):
    done = subprocess.run([sys.executable, "-m", "tests.gpu.cases", *args], cwd=ROOT,
                          env=environment(device), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def assert_states(a, b, atol, rtol=0.0, what=""):
    assert list(a) == list(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=rtol,
                                   msg=lambda m: f"{what} {key}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_mirrored_with_no_arguments_picks_the_device_and_equals_a_plain_loop(device, tmp_path):
    out = tmp_path / "world_one.pt"
    run_case(device, "world_one", str(out))
    result = torch.load(out, weights_only=False)
    facts = result["facts"]
    if device == "cuda":
        assert facts["device"] == "cuda:0"
        assert facts["backend"] == "nccl"
        assert facts["repr"] == "MirroredStrategy(devices=['cuda:0'])"
    else:
        assert facts["device"] == "cpu" and facts["backend"] == "gloo"
    assert facts["parameter_devices"] == [facts["device"]]   # built in scope: on the device
    assert facts["replicas"] == 1
    assert_states(result["ours"], result["plain"], atol=1e-6, what="world 1 vs plain loop")


@pytest.fixture(scope="module", params=DEVICES)
def shared(request, tmp_path_factory):
    """Both processes' results of cases.shared_device on one device."""
    device = request.param
    directory = tmp_path_factory.mktemp(f"shared-{device}")
    init_file = directory / "rendezvous"
    outs = [directory / f"rank{r}.pt" for r in range(2)]
    env = environment(device, LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    processes = [subprocess.Popen([sys.executable, "-m", "tests.gpu.cases", "shared_device",
                                   str(r), str(init_file), str(outs[r])], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=TIMEOUT)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process, log in zip(processes, logs):
        assert process.returncode == 0, log[-5000:]
    return device, [torch.load(out, weights_only=False) for out in outs]


def test_two_processes_share_the_device_over_gloo(shared):
    device, results = shared
    for result in results:
        assert result["backend"] == "gloo" and result["replicas"] == 2
        assert result["device"] == ("cuda:0" if device == "cuda" else "cpu")


def test_sharing_the_device_trains_as_one_device_with_gradients_from_a_busy_stream(shared):
    _, results = shared
    # Every replica holds the same values, bit for bit.
    assert_states(results[0]["fp32"]["final"], results[1]["fp32"]["final"], atol=0)
    # And one device's: the two halves' gradients summed, not stale or partial ones.
    assert_states(results[0]["fp32"]["final"], results[0]["fp32"]["one_device"], atol=1e-5,
                  what="2 processes vs one device")


def test_bf16_autocast_on_two_replicas_trains_as_one_device(shared):
    _, results = shared
    assert_states(results[0]["bf16"]["final"], results[1]["bf16"]["final"], atol=0)
    # bf16 products of half a batch against the whole batch: within bf16's rounding.
    assert_states(results[0]["bf16"]["final"], results[0]["bf16"]["one_device"], atol=2e-3,
                  rtol=1e-2, what="bf16 autocast, 2 processes vs one device")


def test_fp16_overflow_on_one_replica_skips_the_step_on_every_replica(shared):
    _, results = shared
    for result in results:
        trace = result["fp16"]["trace"]
        assert len(trace) == cases.STEPS
        for step, (before, after, changed) in enumerate(trace):
            if step == cases.OVERFLOW_STEP:
                assert not changed and after == before / 2, (step, trace)
            else:
                assert changed and after == before, (step, trace)
    assert results[0]["fp16"]["trace"] == results[1]["fp16"]["trace"]
    assert_states(results[0]["fp16"]["final"], results[1]["fp16"]["final"], atol=0)
    assert_states(results[0]["fp16"]["final"], results[0]["fp16"]["one_device"], atol=2e-3,
                  rtol=1e-2, what="fp16 + GradScaler, 2 processes vs one device")


def _replicas(device):
    # NCCL cannot put two ranks on one GPU: two replicas where there are two GPUs, else one
    # (the compression's kernels and collectives still run on CUDA tensors).
    return min(2, torch.cuda.device_count()) if device == "cuda" else 2


@pytest.mark.parametrize("device,kind", (
    [] if CUDA_ONLY else [pytest.param("cpu", "int8", id="cpu-int8")]) + [
    pytest.param("cuda", kind, id=f"cuda-{kind}", marks=needs_cuda)
    for kind in ("bf16", "int8", "powersgd", "int8-overlap", "powersgd-overlap")])
def test_compression_over_nccl_equals_compression_over_gloo(device, kind, monkeypatch):
    for name, value in environment(device).items():
        monkeypatch.setenv(name, value)
    if device == "cpu":
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    n = _replicas(device)
    nccl = launch(cases.compressed_training, kind, "nccl", n=n)
    ring = launch(cases.compressed_training, kind, "ring", n=n)
    assert ring["backend"] == "gloo" and nccl["replicas"] == ring["replicas"] == n
    assert nccl["backend"] == ("nccl" if device == "cuda" else "gloo")
    assert nccl["device"] == ring["device"] == ("cuda:0" if device == "cuda" else "cpu")
    for step, (a, b) in enumerate(zip(nccl["applied"], ring["applied"])):
        for i, (x, y) in enumerate(zip(a, b)):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6,
                                       msg=lambda m: f"step {step} gradient {i}: {m}")
    assert_states(nccl["final"], ring["final"], atol=1e-6, rtol=1e-6)
