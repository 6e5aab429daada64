"""The Lightning adapter: Trainer(strategy=...) on torchstrategy strategies.

Training runs are plain `python tests/scripts/lightning_train.py ...` subprocesses (each
with a timeout), because both launchers under comparison start the second replica by
running the command again: Lightning's own `strategy="ddp"` (CPU, gloo, devices=2) and our
re-execution launcher. Lightning's ddp picks its rendezvous port through the OS (no
MASTER_PORT in the environment), and so does ours.

Each launch costs seconds of Lightning imports per process, so the five launches
(`SCENARIOS`) start once, at the module's first test, two at a time
(tests/lightning/scenario_runner.py), while the in-process tests run; each test reads the
result of the launch it is about, and a launch that failed fails only the tests reading it,
with its own output. Each launch's first process is a fresh interpreter that imported
torchstrategy and Lightning in a known order, so the registration tests read what it
recorded there (before it trained) instead of starting interpreters of their own.
"""
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

import torchstrategy as ts
from tests.helpers.lightning_runs import ROOT, SUBPROCESS_TIMEOUT_SECONDS, clean_env

pytestmark = pytest.mark.lightning

TOLERANCE = dict(atol=1e-6, rtol=0)
SCRIPT = os.path.join(ROOT, "tests", "scripts", "lightning_train.py")
RUNNER = os.path.join(ROOT, "tests", "lightning", "scenario_runner.py")
# Launches running at once: each re-executed launch imports in one process and then in the
# other, so two launches keep two cores busy.
PARALLEL_LAUNCHES = 2
# Every collective's bound in the launches (clean_env's is 60 s). Replica 0 waits in the
# rendezvous while replica 1 imports torch and Lightning (10 s of CPU), which the other
# launch and the in-process tests slow down on a loaded machine; a hang still fails within
# the launch's own timeout.
COLLECTIVE_TIMEOUT_SECONDS = 120


def _assert_same_weights(ours, theirs):
    assert list(ours) == list(theirs)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], **TOLERANCE,
                                   msg=lambda m: f"{key}: {m}")


# -- the launches -----------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """One run of the training script: its arguments, and how it is started (a plain
    script, a program read on stdin, or under torchrun)."""
    argv: tuple[str, ...]
    stdin: bool = False
    torchrun: bool = False

    def command(self, out_dir):
        argv = [*self.argv, "--out", str(out_dir)]
        if self.torchrun:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", SCRIPT, *argv]
        if self.stdin:
            return [sys.executable, "-", *argv]
        return [sys.executable, SCRIPT, *argv]


_MULTI_WORKER = ("--also", "multi_worker_mirrored") if hasattr(ts, "MultiWorkerMirroredStrategy") \
    else ()
# In start order (about the longest first). The comments give the import order of each
# launch's first process, which the registration tests read.
SCENARIOS = {
    # Trainer(strategy="mirrored", devices=2) re-executes the script for replica 1, then
    # strategy="ddp" in the same world. lightning.pytorch after torchstrategy.
    "boring": Scenario(("--strategy", "mirrored", "--also", "ddp", "--probe-registration")),
    # ModelCheckpoint and fit(ckpt_path=...), then the same steps uninterrupted.
    # pytorch_lightning before torchstrategy.
    "resume": Scenario(("--strategy", "mirrored", "--resume", "--straight-too", "--model",
                        "regression", "--package", "pytorch_lightning", "--import-order",
                        "lightning-first", "--max-steps", "8", "--probe-registration")),
    # LightningStrategy(ts.MirroredStrategy(["cpu:0", "cpu:1"])) launches; then "ddp".
    # pytorch_lightning after torchstrategy.
    "regression": Scenario(("--strategy", "instance", "--model", "regression", "--also", "ddp",
                            "--package", "pytorch_lightning", "--probe-registration")),
    # Under torchrun: "mirrored", then "multi_worker_mirrored" in the same world.
    # torchstrategy, then torchstrategy.lightning (which imports lightning.pytorch).
    "torchrun": Scenario(("--strategy", "mirrored", *_MULTI_WORKER, "--import-order",
                          "adapter-first"), torchrun=True),
    # A program read on stdin (as in a notebook): Trainer(strategy="mirrored") is refused,
    # strategy="mirrored_notebook" forks the replicas at fit. lightning.pytorch before
    # torchstrategy.
    "notebook": Scenario(("--strategy", "mirrored_notebook", "--import-order",
                          "lightning-first", "--probe-registration", "--probe-reexecution"),
                         stdin=True),
}


class Launches:
    """The scenarios, run by one scenario_runner.py process; `result` waits for one."""

    def __init__(self, root, scenarios):
        self._scenarios = dict(scenarios)
        self._dirs = {name: root / name for name in scenarios}
        jobs = [{"command": scenario.command(self._dirs[name]),
                 "stdin": SCRIPT if scenario.stdin else None,
                 "dir": str(self._dirs[name]), "timeout": SUBPROCESS_TIMEOUT_SECONDS}
                for name, scenario in scenarios.items()]
        jobs_file = root / "jobs.json"
        jobs_file.write_text(json.dumps(jobs))
        self._runner_log = open(root / "runner.txt", "w+")
        env = clean_env()
        env["TORCHSTRATEGY_TIMEOUT_SECONDS"] = str(COLLECTIVE_TIMEOUT_SECONDS)
        self._runner = subprocess.Popen(
            [sys.executable, RUNNER, str(jobs_file), str(PARALLEL_LAUNCHES)], cwd=ROOT,
            env=env, stdout=self._runner_log, stderr=subprocess.STDOUT,
            start_new_session=True)
        # The longest a launch can wait for its turn and then run.
        self._wait_seconds = SUBPROCESS_TIMEOUT_SECONDS * math.ceil(
            len(jobs) / PARALLEL_LAUNCHES) + 30

    def path(self, name):
        return self._dirs[name]

    def result(self, name):
        """What scenario `name`'s replica 0 saved; fails with the launch's own output if it
        failed."""
        status_file = self._dirs[name] / "exit_status"
        deadline = time.monotonic() + self._wait_seconds
        while not status_file.exists():
            if self._runner.poll() is not None and not status_file.exists():
                self._runner_log.seek(0)
                pytest.fail(f"scenario_runner.py exited with {self._runner.returncode} "
                            f"before {name!r} ended:\n{self._runner_log.read()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"{name!r} has not ended after {self._wait_seconds} s")
            time.sleep(0.2)
        status = status_file.read_text()
        if status != "0":
            stdout = (self._dirs[name] / "stdout.txt").read_text()
            stderr = (self._dirs[name] / "stderr.txt").read_text()
            seconds = (self._dirs[name] / "seconds").read_text()
            if status == "timeout":
                what = f"ran past its timeout ({SUBPROCESS_TIMEOUT_SECONDS} s) and was killed"
            elif int(status) < 0:
                what = f"was killed by {signal.Signals(-int(status)).name} after {seconds} s"
            else:
                what = f"exited with {status} after {seconds} s"
            pytest.fail(f"{name!r} ({' '.join(self._scenarios[name].argv)}) {what}\n"
                        f"--- stdout ---\n{stdout[-3000:]}\n--- stderr ---\n{stderr[-5000:]}")
        return torch.load(self._dirs[name] / "result.pt", weights_only=False)

    def close(self):
        """Ends the runner and the launches still running (after a test failed early)."""
        if self._runner.poll() is None:
            self._runner.send_signal(signal.SIGTERM)
            try:
                self._runner.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._runner.pid, signal.SIGKILL)
                self._runner.wait()
        self._runner_log.close()


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    started = Launches(tmp_path_factory.mktemp("launches"), SCENARIOS)
    yield started
    started.close()


@pytest.fixture(scope="module", autouse=True)
def _start_launches_early(request):
    """Starts the launches at the module's first test, so that they run while the in-process
    tests do, where any selected test reads them."""
    if any("launches" in item.fixturenames for item in request.session.items
           if item.module is request.module):
        request.getfixturevalue("launches")


# -- registration -----------------------------------------------------------------------
def test_registered_names_do_not_collide_with_lightnings_own():
    from lightning.pytorch.strategies import StrategyRegistry

    import torchstrategy.lightning.lightning_pytorch  # noqa: F401  registers the names
    from torchstrategy.lightning_base import registration

    names = registration.registered_names("lightning.pytorch")
    assert {"mirrored", "mirrored_notebook", "one_device"} <= set(names)
    for ours, registered in names.items():
        entry = StrategyRegistry[registered]
        assert entry["strategy"].__name__.startswith("torchstrategy_"), registered
        assert registered in (ours, "ts_" + ours)
    # Our names for strategies that do not exist (yet) are not registered.
    for ours, (cls, *_rest) in registration._NAMES.items():
        assert (ours in names) == hasattr(ts, cls)


# -- mismatched Trainer arguments -------------------------------------------------------
def _trainer(**kwargs):
    import lightning.pytorch as pl

    import torchstrategy.lightning.lightning_pytorch  # noqa: F401  registers the names

    kwargs.setdefault("logger", False)
    return pl.Trainer(**kwargs)


def _one_device():
    from torchstrategy.lightning import LightningStrategy

    return LightningStrategy(ts.OneDeviceStrategy("cpu"))


def _fit_one_step(trainer):
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer.fit(BoringModel())


def test_wrapped_strategy_decides_devices_when_left_at_auto():
    """devices and accelerator left at "auto" (or given as the strategy has them): the
    strategy decides, and at one replica Lightning still gives the loader a
    DistributedSampler, as it does under "ddp" (whose is_distributed is always True), so
    both shuffle alike."""
    from torch.utils.data import DistributedSampler

    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    for arguments in ({}, {"devices": 1, "accelerator": "cpu"}):
        trainer = _trainer(strategy=_one_device(), max_steps=1, enable_progress_bar=False,
                           enable_model_summary=False, enable_checkpointing=False,
                           **arguments)
        assert trainer.strategy.root_device == torch.device("cpu")
        assert trainer.num_devices == 1 and trainer.world_size == 1
        _fit_one_step(trainer)
        assert trainer.global_step == 1 and trainer.strategy.is_distributed
        assert isinstance(trainer.train_dataloader.sampler, DistributedSampler)
        # A lone replica divides no cores: this process's threads and environment stay as
        # they were (a thread count left in the environment would reach every process it
        # starts later, replicas included).
        assert torch.get_num_threads() == threads
        assert os.environ.get("OMP_NUM_THREADS") == omp


def test_mismatched_devices_is_a_clear_error():
    """Lightning keeps the devices argument from a strategy object until the Trainer is
    built, so the error comes at the start of fit, before anything runs."""
    trainer = _trainer(strategy=_one_device(), devices=2, max_steps=1,
                       enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"Trainer\(devices=2\) disagrees with "
                       r"OneDeviceStrategy\(device='cpu:0'\), which runs 1 replica\(s\) on this "
                       r"machine. Leave devices at 'auto' \(or pass devices=1\)"):
        _fit_one_step(trainer)
    assert trainer.global_step == 0


def test_mismatched_accelerator_is_a_clear_error():
    """The strategy's devices make Lightning take their device type (a CPU strategy stays
    on CPU under accelerator="auto") and refuse another accelerator itself, while the
    Trainer is built."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=r"CPU parallel_devices set through "
                       r"LightningStrategy class, but accelerator set to cuda, please choose "
                       r"one device type"):
        _trainer(strategy=_one_device(), accelerator="cuda")


def test_accelerator_lightning_assigns_is_checked_against_the_strategy():
    """For device types whose strategy devices Lightning does not tie to an accelerator
    (it does so for CPU and CUDA only), the adapter checks the accelerator the connector
    assigns it, before set_world_ranks returns (as the connector calls it)."""
    from lightning.pytorch.accelerators import CUDAAccelerator

    strategy = _one_device()
    strategy.accelerator = CUDAAccelerator()
    with pytest.raises(ValueError, match=r"The Trainer's accelerator \(CUDAAccelerator\) "
                       r"disagrees with OneDeviceStrategy\(device='cpu:0'\), whose replicas "
                       r"run on cpu. Leave accelerator at 'auto' \(or pass accelerator='cpu'\)"):
        strategy.set_world_ranks()


def test_mismatched_num_nodes_is_a_clear_error():
    with pytest.raises(ValueError, match=r"Trainer\(num_nodes=2\) disagrees with "
                       r"OneDeviceStrategy\(device='cpu:0'\), which spans 1 machine\(s\). "
                       r"Pass num_nodes=1."):
        _trainer(strategy=_one_device(), num_nodes=2)


def test_registered_name_with_wrong_device_count_is_a_clear_error():
    with pytest.raises(ValueError, match=r"Trainer\(strategy='one_device'\) runs one replica, "
                       r"but the Trainer asks for 2 device\(s\) on 1 node\(s\). Pass devices=1"):
        _trainer(strategy="one_device", accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match=r"Trainer\(strategy='mirrored'\) runs on one machine, "
                       r"but num_nodes=2. Use strategy='multi_worker_mirrored'"):
        _trainer(strategy="mirrored", accelerator="cpu", devices=2, num_nodes=2)


def test_one_process_strategies_are_refused_with_the_reason():
    """CentralStorageStrategy runs its replicas as threads of one process; Lightning's loop
    runs once per process, so the adapter refuses it (by name or object) and says why."""
    message = (r"CentralStorageStrategy runs all its replicas inside one process .* Use "
               r"Trainer\(strategy='mirrored'\)")
    with pytest.raises(ValueError, match=message):
        _trainer(strategy="central_storage", accelerator="cpu", devices=1)
    from torchstrategy.lightning import LightningStrategy

    with pytest.raises(ValueError, match=message):
        LightningStrategy(ts.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"]))


# -- collectives ------------------------------------------------------------------------
def _collectives_replica():
    from torchstrategy.lightning import LightningStrategy

    strategy = LightningStrategy(ts.MirroredStrategy())
    rank = strategy.global_rank
    x = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    strategy.barrier("start")
    return {
        "ranks": (strategy.global_rank, strategy.world_size, strategy.is_global_zero),
        "mean": strategy.reduce(x).tolist(),
        "sum": strategy.reduce(x, reduce_op="sum").tolist(),
        "max": strategy.reduce(x, reduce_op="max").tolist(),
        "torch_sum": strategy.reduce(x, reduce_op=torch.distributed.ReduceOp.SUM).tolist(),
        "gather": strategy.all_gather(x).tolist(),
        "broadcast": strategy.broadcast({"from": rank}, src=1),
        "all": strategy.reduce_boolean_decision(rank == 0, all=True),
        "any": strategy.reduce_boolean_decision(rank == 0, all=False),
        "sampler": strategy.distributed_sampler_kwargs,
        "not_a_tensor": strategy.reduce(3.5),
    }


@pytest.mark.timeout(120)
def test_collectives_on_two_replicas():
    # Forked from this process, which imported Lightning already: each replica of the
    # default fork server would import it again (seconds each). What the test checks (the
    # adapter's collectives in a launched world) does not depend on how replicas start.
    pytest.importorskip("lightning.pytorch")
    import torchstrategy.lightning  # noqa: F401

    out = ts.launch(_collectives_replica, num_replicas=2, timeout_seconds=60,
                    start_method="fork")
    assert out["ranks"] == (0, 2, True)
    assert out["mean"] == [1.5, 15.0]
    assert out["sum"] == out["torch_sum"] == [3.0, 30.0]
    assert out["max"] == [2.0, 20.0]
    assert out["gather"] == [[1.0, 10.0], [2.0, 20.0]]
    assert out["broadcast"] == {"from": 1}
    assert out["all"] is False and out["any"] is True
    assert out["sampler"] == {"num_replicas": 2, "rank": 0}
    assert out["not_a_tensor"] == 3.5


def test_lightning_strategy_needs_a_strategy_or_a_kind():
    from torchstrategy.lightning import LightningStrategy

    with pytest.raises(ValueError, match="needs a torchstrategy strategy"):
        LightningStrategy()
    with pytest.raises(TypeError, match="wraps a torchstrategy strategy, got int"):
        LightningStrategy(3)
    with pytest.raises(ValueError, match="pass kind='mirrored'"):
        LightningStrategy(ts.OneDeviceStrategy("cpu"), start_method="fork")
    with pytest.raises(ValueError, match="start_method must be 'popen' or 'fork'"):
        LightningStrategy(kind="mirrored", start_method="spawn")


def test_bad_arguments_are_refused_at_construction():
    """Not accepted until fit: the error names the accepted values."""
    from torchstrategy.lightning import LightningStrategy

    with pytest.raises(ValueError, match=r"kind must be one of \['mirrored', "
                       r"'multi_worker_mirrored', 'one_device', 'sharded'\], got 'bogus'"):
        LightningStrategy(kind="bogus")
    with pytest.raises(ValueError, match=r"start_method 'popen', not 'fork'"):
        LightningStrategy(kind="one_device", start_method="fork")
    with pytest.raises(ValueError, match=r"package must be one of \('lightning.pytorch', "
                       r"'pytorch_lightning'\)"):
        LightningStrategy(kind="mirrored", package="lightning")
    with pytest.raises(ValueError, match="CentralStorageStrategy runs all its replicas"):
        LightningStrategy(kind="central_storage")


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_adapter_is_a_module_level_class_of_either_package(package):
    import importlib

    from torchstrategy.lightning import LightningStrategy

    strategy = LightningStrategy(ts.OneDeviceStrategy("cpu"), package=package)
    module = importlib.import_module(f"{package}.strategies")
    assert isinstance(strategy, module.ParallelStrategy)
    assert isinstance(strategy, LightningStrategy)
    cls = type(strategy)
    assert importlib.import_module(cls.__module__).LightningStrategy is cls
    assert "mirrored" in module.StrategyRegistry


# -- equivalence with Lightning's DDP (the launches) --------------------------------------
@pytest.fixture(scope="module")
def boring_mirrored(launches):
    """Trainer(strategy="mirrored", devices=2), then strategy="ddp" in the same world."""
    return launches.result("boring")


@pytest.fixture(scope="module")
def boring_ddp(boring_mirrored):
    return boring_mirrored["ddp"]


@pytest.mark.timeout(600)
def test_boring_model_registered_name_matches_ddp(boring_mirrored, boring_ddp):
    """Trainer(strategy="mirrored", devices=2) vs strategy="ddp": same weights after 6
    optimizer steps of 2 accumulated batches each (no_sync during accumulation)."""
    ours = boring_mirrored
    assert ours["strategy"] == "LightningStrategy" and boring_ddp["strategy"] == "DDPStrategy"
    assert ours["world_size"] == boring_ddp["world_size"] == 2
    assert ours["global_step"] == boring_ddp["global_step"] == 6
    _assert_same_weights(ours["state_dict"], boring_ddp["state_dict"])
    # The runs trained (not a comparison of untouched initial weights).
    assert any((boring_ddp["state_dict"][key] - value).abs().max() > 1e-3
               for key, value in _initial_boring_weights().items())


def _initial_boring_weights():
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.demos.boring_classes import BoringModel

    pl.seed_everything(7)
    return BoringModel().state_dict()


@pytest.mark.timeout(600)
def test_boring_model_in_notebook_mode_matches_ddp(launches, boring_ddp):
    """Trainer(strategy="mirrored_notebook") from a program read on stdin (where
    re-execution is impossible, as in a notebook): replicas are forked at fit and the
    trained weights come back into the calling process."""
    ours = launches.result("notebook")
    _assert_same_weights(ours["state_dict"], boring_ddp["state_dict"])


@pytest.fixture(scope="module")
def boring_torchrun(launches):
    """The same script under torchrun: Trainer(strategy="mirrored"), then
    strategy="multi_worker_mirrored" in the same torchrun world."""
    return launches.result("torchrun")


@pytest.mark.timeout(600)
def test_boring_model_under_torchrun_matches_ddp(boring_torchrun, boring_ddp):
    """The strategy joins torchrun's world."""
    ours = boring_torchrun
    assert ours["world_size"] == 2 and ours["strategy"] == "LightningStrategy"
    _assert_same_weights(ours["state_dict"], boring_ddp["state_dict"])


@pytest.mark.timeout(600)
def test_boring_model_multi_worker_name_under_torchrun_matches_ddp(boring_torchrun, boring_ddp):
    """Trainer(strategy="multi_worker_mirrored") under torchrun (one machine here)."""
    if not hasattr(ts, "MultiWorkerMirroredStrategy"):
        pytest.skip("MultiWorkerMirroredStrategy is not in this torchstrategy")
    ours = boring_torchrun["multi_worker_mirrored"]
    assert ours["world_size"] == 2 and ours["strategy"] == "LightningStrategy"
    _assert_same_weights(ours["state_dict"], boring_ddp["state_dict"])


@pytest.mark.timeout(600)
def test_regression_fit_validate_test_predict_match_ddp(launches):
    """LightningStrategy(ts.MirroredStrategy(["cpu:0", "cpu:1"])) (of pytorch_lightning,
    the package imported): weights, synced logged metrics (mean and max), validate/test
    results and predictions equal DDP's (fitted in the same world after ours)."""
    ours = launches.result("regression")
    theirs = ours["ddp"]
    assert ours["lightning_modules"] == ["pytorch_lightning"]
    assert ours["strategy"] == "LightningStrategy" and theirs["strategy"] == "DDPStrategy"
    _assert_same_weights(ours["state_dict"], theirs["state_dict"])
    assert set(ours["metrics"]) == {"train_loss", "val_loss", "val_max"}
    for name, value in theirs["metrics"].items():
        assert ours["metrics"][name] == pytest.approx(value, abs=1e-6), name
    for stage in ("validate", "test"):
        assert ours[stage][0].keys() == theirs[stage][0].keys()
        for name, value in theirs[stage][0].items():
            assert ours[stage][0][name] == pytest.approx(value, abs=1e-6), (stage, name)
    torch.testing.assert_close(ours["predictions"], theirs["predictions"], **TOLERANCE)


@pytest.mark.timeout(600)
def test_checkpoint_resume_with_pytorch_lightning(launches):
    """pytorch_lightning imported before torchstrategy: ModelCheckpoint written by replica
    0 with the module's own keys (no "module." prefix); fit(ckpt_path=...) resumed at half
    way ends exactly where an uninterrupted run (the same launch's next fit) ends."""
    resumed = launches.result("resume")
    straight = resumed["straight"]
    assert resumed["lightning_modules"] == ["pytorch_lightning"]
    assert resumed["import_order"] == "lightning-first"
    assert resumed["checkpoint_keys"] == sorted(straight["state_dict"])
    assert resumed["global_step"] == straight["global_step"] == 8
    _assert_same_weights(resumed["state_dict"], straight["state_dict"])
    assert sorted(os.listdir(launches.path("resume") / "ckpt")) == ["epoch=0-step=4.ckpt",
                                                                      "last.ckpt"]


# -- registration, read in the launches' fresh interpreters ----------------------------------
@pytest.mark.timeout(600)
def test_import_torchstrategy_does_not_import_lightning(boring_torchrun):
    """`import torchstrategy` imports no Lightning and installs no import hook; importing
    `torchstrategy.lightning` (or asking for ts.LightningStrategy) is what imports it and
    registers the names in Lightning's own StrategyRegistry (recorded by the torchrun
    launch's replica 0 as it imported them, in that order, before anything else)."""
    assert boring_torchrun["import_order"] == "adapter-first"
    assert boring_torchrun["imports"] == {
        "lightning_after_torchstrategy": [], "hooks_unchanged_after_torchstrategy": True,
        "registered_by_adapter": True, "same_class": True,
        "hooks_unchanged_after_adapter": True}


# (package, which is imported first) -> the launch whose first process imported them so.
_IMPORTED_SO = {("lightning.pytorch", "torchstrategy-first"): "boring",
                ("lightning.pytorch", "lightning-first"): "notebook",
                ("pytorch_lightning", "torchstrategy-first"): "regression",
                ("pytorch_lightning", "lightning-first"): "resume"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
@pytest.mark.parametrize("order", ["torchstrategy-first", "lightning-first"])
def test_names_registered_whichever_is_imported_first(launches, package, order):
    """In a fresh interpreter that imported `package` and torchstrategy in `order`, then
    torchstrategy.lightning: our names are in the package's StrategyRegistry, and
    Trainer(strategy="one_device") builds our adapter (a Lightning Strategy of that
    package) on a OneDeviceStrategy."""
    run = launches.result(_IMPORTED_SO[package, order])
    assert run["lightning_modules"] == [package.split(".")[0]]
    assert run["import_order"] == order
    assert run["registration"] == {
        "names": ["mirrored", "mirrored_notebook", "one_device"], "is_adapter": True,
        "is_lightning_strategy": True, "torchstrategy": "OneDeviceStrategy(device='cpu:0')"}


@pytest.mark.timeout(600)
def test_mirrored_where_reexecution_is_impossible_names_the_notebook_mode(launches):
    """A program read from stdin (like a notebook) cannot be re-executed: the error says
    to use strategy="mirrored_notebook"."""
    error = launches.result("notebook")["reexecution_error"]
    assert error is not None, "Trainer(strategy='mirrored') was built from stdin"
    assert "cannot re-execute an interactive session or a notebook" in error
    assert "With Lightning, use Trainer(strategy='mirrored_notebook') to start the " \
        "replicas at fit time instead." in error, error
