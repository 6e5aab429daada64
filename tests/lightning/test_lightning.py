"""The Lightning adapter: Trainer(strategy=...) on torchstrategy strategies.

Training runs are plain `python tests/scripts/lightning_train.py ...` subprocesses (each
with a timeout), because both launchers under comparison start the second replica by
running the command again: Lightning's own `strategy="ddp"` (CPU, gloo, devices=2) and our
re-execution launcher. Lightning's ddp picks its rendezvous port through the OS (no
MASTER_PORT in the environment), and so does ours.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torchstrategy as ts
from tests.helpers.lightning_runs import ROOT, clean_env, run_training

pytestmark = pytest.mark.lightning

TOLERANCE = dict(atol=1e-6, rtol=0)


def _assert_same_weights(ours, theirs):
    assert list(ours) == list(theirs)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], **TOLERANCE,
                                   msg=lambda m: f"{key}: {m}")


# -- equivalence with Lightning's DDP ----------------------------------------------------
# Each launch of two Lightning replicas costs seconds of imports: the script fits again in
# the same world (--also NAME): Lightning's own strategy="ddp", which starts nothing and
# gives the reference, or another of our names under the same torchrun.
@pytest.fixture(scope="module")
def boring_mirrored(tmp_path_factory):
    """Trainer(strategy="mirrored", devices=2), then strategy="ddp" in the same world."""
    return run_training(tmp_path_factory.mktemp("mirrored"), "--strategy", "mirrored",
                        "--also", "ddp")


@pytest.fixture(scope="module")
def boring_ddp(boring_mirrored):
    return boring_mirrored["ddp"]


@pytest.mark.timeout(400)
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


@pytest.mark.timeout(400)
def test_boring_model_in_notebook_mode_matches_ddp(boring_ddp, tmp_path):
    """Trainer(strategy="mirrored_notebook") from a program read on stdin (where
    re-execution is impossible, as in a notebook): replicas are forked at fit and the
    trained weights come back into the calling process."""
    ours = run_training(tmp_path, "--strategy", "mirrored_notebook", stdin=True)
    _assert_same_weights(ours["state_dict"], boring_ddp["state_dict"])


@pytest.fixture(scope="module")
def boring_torchrun(tmp_path_factory):
    """The same script under torchrun: Trainer(strategy="mirrored"), then
    strategy="multi_worker_mirrored" in the same torchrun world."""
    also = ("--also", "multi_worker_mirrored") if hasattr(ts, "MultiWorkerMirroredStrategy") \
        else ()
    return run_training(tmp_path_factory.mktemp("torchrun"), "--strategy", "mirrored", *also,
                        torchrun=True)


@pytest.mark.timeout(400)
def test_boring_model_under_torchrun_matches_ddp(boring_torchrun, boring_ddp):
    """The strategy joins torchrun's world."""
    ours = boring_torchrun
    assert ours["world_size"] == 2 and ours["strategy"] == "LightningStrategy"
    _assert_same_weights(ours["state_dict"], boring_ddp["state_dict"])


@pytest.mark.timeout(400)
def test_boring_model_multi_worker_name_under_torchrun_matches_ddp(boring_torchrun, boring_ddp):
    """Trainer(strategy="multi_worker_mirrored") under torchrun (one machine here)."""
    if not hasattr(ts, "MultiWorkerMirroredStrategy"):
        pytest.skip("MultiWorkerMirroredStrategy is not in this torchstrategy")
    ours = boring_torchrun["multi_worker_mirrored"]
    assert ours["world_size"] == 2 and ours["strategy"] == "LightningStrategy"
    _assert_same_weights(ours["state_dict"], boring_ddp["state_dict"])


@pytest.mark.timeout(400)
def test_regression_fit_validate_test_predict_match_ddp(tmp_path):
    """LightningStrategy(ts.MirroredStrategy(["cpu:0", "cpu:1"])): weights, synced logged
    metrics (mean and max), validate/test results and predictions equal DDP's (fitted in
    the same world after ours)."""
    ours = run_training(tmp_path, "--strategy", "instance", "--model", "regression",
                        "--also", "ddp")
    theirs = ours["ddp"]
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


@pytest.mark.timeout(400)
def test_checkpoint_resume_with_pytorch_lightning(tmp_path):
    """pytorch_lightning imported before torchstrategy: ModelCheckpoint written by replica
    0 with the module's own keys (no "module." prefix); fit(ckpt_path=...) resumed at half
    way ends exactly where an uninterrupted run (the same launch's next fit) ends."""
    resumed = run_training(tmp_path / "resumed", "--strategy", "mirrored", "--resume",
                           "--straight-too", "--model", "regression", "--package",
                           "pytorch_lightning", "--import-order", "lightning-first",
                           "--max-steps", "8")
    straight = resumed["straight"]
    assert resumed["lightning_modules"] == ["pytorch_lightning"]
    assert resumed["checkpoint_keys"] == sorted(straight["state_dict"])
    assert resumed["global_step"] == straight["global_step"] == 8
    _assert_same_weights(resumed["state_dict"], straight["state_dict"])
    assert sorted(os.listdir(tmp_path / "resumed" / "ckpt")) == ["epoch=0-step=4.ckpt",
                                                                   "last.ckpt"]


# -- registration -----------------------------------------------------------------------
def _python(code, timeout=120):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                            env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.timeout(150)
def test_import_torchstrategy_does_not_import_lightning():
    """`import torchstrategy` imports no Lightning and installs no import hook; importing
    `torchstrategy.lightning` (or asking for ts.LightningStrategy) is what imports it and
    registers the names in Lightning's own StrategyRegistry."""
    out = _python("""
        import sys
        hooks = list(sys.meta_path)
        import torchstrategy as ts
        print(sorted(m for m in sys.modules if m.split(".")[0] in
                     ("lightning", "pytorch_lightning", "lightning_fabric")),
              sys.meta_path == hooks)
        from torchstrategy.lightning import LightningStrategy
        from lightning.pytorch.strategies import StrategyRegistry
        print("mirrored" in StrategyRegistry, ts.LightningStrategy is LightningStrategy,
              sys.meta_path == hooks)
    """)
    assert out.strip().splitlines()[-2:] == ["[] True", "True True True"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
@pytest.mark.parametrize("order", ["torchstrategy-first", "lightning-first"])
def test_names_registered_whichever_is_imported_first(package, order):
    first, second = ("import torchstrategy", f"import {package} as pl")
    if order == "lightning-first":
        first, second = second, first
    out = _python(f"""
        {first}
        {second}
        import {package} as pl
        from {package}.strategies import StrategyRegistry
        from torchstrategy.lightning import LightningStrategy
        names = [n for n in ("mirrored", "mirrored_notebook", "one_device") if n in StrategyRegistry]
        trainer = pl.Trainer(strategy="one_device", accelerator="cpu", devices=1, logger=False)
        print(names, isinstance(trainer.strategy, LightningStrategy),
              isinstance(trainer.strategy, pl.strategies.Strategy), trainer.strategy.torchstrategy)
    """)
    assert out.strip().splitlines()[-1] == (
        "['mirrored', 'mirrored_notebook', 'one_device'] True True "
        "OneDeviceStrategy(device='cpu:0')")


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

    for arguments in ({}, {"devices": 1, "accelerator": "cpu"}):
        trainer = _trainer(strategy=_one_device(), max_steps=1, enable_progress_bar=False,
                           enable_model_summary=False, enable_checkpointing=False,
                           **arguments)
        assert trainer.strategy.root_device == torch.device("cpu")
        assert trainer.num_devices == 1 and trainer.world_size == 1
        _fit_one_step(trainer)
        assert trainer.global_step == 1 and trainer.strategy.is_distributed
        assert isinstance(trainer.train_dataloader.sampler, DistributedSampler)


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


@pytest.mark.timeout(150)
def test_mirrored_where_reexecution_is_impossible_names_the_notebook_mode():
    """A program read from stdin (like a notebook) cannot be re-executed: the error says
    to use strategy="mirrored_notebook"."""
    code = textwrap.dedent("""
        import lightning.pytorch as pl
        import torchstrategy.lightning
        try:
            pl.Trainer(strategy="mirrored", accelerator="cpu", devices=2, logger=False)
        except RuntimeError as error:
            print("ERROR:", error)
    """)
    result = subprocess.run([sys.executable, "-"], input=code, cwd=ROOT, env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cannot re-execute an interactive session or a notebook" in result.stdout
    assert "With Lightning, use Trainer(strategy='mirrored_notebook') to start the " \
        "replicas at fit time instead." in result.stdout, result.stdout


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
