"""PreemptionCheckpointHandler refuses what would fail later, and says what to do (issue 26,
items 5 and 6): its directory is checked when it is made, on the chief, with the same error
on every replica; a failed save ends every replica with the reason; a replica waiting for
the chief honours SIGTERM; a stale, truncated or foreign checkpoint is named; its actions
show on stderr in a program that configured no logging. Also: the other cryptic cases of
the issue (`compute_average_loss`'s sample_weight, a parameter-server spec giving two tasks
one address, a `ts.launch` parent ended by SIGTERM)."""
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchstrategy as ts
from torchstrategy.checkpoint import write_atomically
from torchstrategy.fault_tolerance import termination
from torchstrategy.fault_tolerance.preemption import PreemptionSaveError
from tests.helpers import ROOT
from tests.helpers.processes import alive, plain_environment
from tests.helpers.replicas import launch

pytestmark = pytest.mark.timeout(180)


class _Counter:
    def __init__(self):
        self.value = torch.zeros(())

    def state_dict(self):
        return {"value": self.value.clone()}

    def load_state_dict(self, state):
        self.value = state["value"].clone()


def _handler(directory, objects=None, **config):
    handler = ts.PreemptionCheckpointHandler(
        None, objects if objects is not None else {"counter": _Counter()}, directory,
        ts.TerminationConfig(**config) if config else None)
    handler._watcher.stop()  # these tests never signal it
    return handler


# -- the directory, checked at construction ------------------------------------------------

def test_a_missing_directory_is_made_private_and_a_file_is_refused(tmp_path):
    directory = tmp_path / "a" / "b"
    _handler(directory)
    assert directory.is_dir() and (directory.stat().st_mode & 0o777) == 0o700
    assert os.listdir(directory) == []  # the probe of the write left nothing
    path = tmp_path / "not_a_dir"
    path.write_text("x")
    with pytest.raises(NotADirectoryError, match=f"checkpoint_dir {path} is a file, not a "
                                                 "directory. Give the path of a directory"):
        _handler(path)
    with pytest.raises(NotADirectoryError, match=f"checkpoint_dir {path}/sub does not exist "
                                                 "and cannot be created"):
        _handler(path / "sub")


def test_a_directory_others_can_write_is_refused_in_the_handlers_words(tmp_path):
    for mode, who in ((0o777, "writable by every user"), (0o770, "writable by its group")):
        tmp_path.chmod(mode)
        with pytest.raises(PermissionError) as caught:
            _handler(tmp_path)
        message = str(caught.value)
        assert message.startswith(f"PreemptionCheckpointHandler: checkpoint_dir {tmp_path} "
                                  f"is {who} (mode {mode:o})")
        assert f"chmod go-w {tmp_path}" in message and "BackupAndRestore" not in message
    tmp_path.chmod(0o700)
    _handler(tmp_path)


def test_a_directory_this_process_cannot_write_is_refused_now(tmp_path):
    if os.geteuid() != 0:
        directory = tmp_path / "read_only"
        directory.mkdir(mode=0o500)
    else:
        # root writes through permission bits; /proc/self is a directory of this process
        # (uid root, mode 555) in which nothing can be created.
        directory = "/proc/self"
    with pytest.raises(PermissionError, match=f"checkpoint_dir {directory} is not writable "
                                              "by this process .*could not be saved when a "
                                              "preemption comes"):
        _handler(directory)


# -- checkpoints that cannot be restored ---------------------------------------------------

def test_an_empty_or_truncated_checkpoint_is_named_corrupt(tmp_path):
    handler = _handler(tmp_path)
    path = tmp_path / "preemption.pt"
    assert handler.path == str(path)
    torch.save({"format": 1, "total_run_calls": 1, "objects": {}, "x": torch.zeros(1000)},
               path)
    whole = path.read_bytes()
    for content, cause in ((b"", "EOFError"), (whole[:len(whole) // 2], "RuntimeError")):
        path.write_bytes(content)
        with pytest.raises(RuntimeError) as caught:
            _handler(tmp_path)
        assert str(caught.value).startswith(f"The preemption checkpoint {path} is truncated "
                                            f"or corrupt ({cause}")
        assert str(caught.value).endswith("delete it to start afresh (training then starts "
                                          "from step 0), or put back a complete copy.")
    torch.save({"model": torch.zeros(2)}, path)  # some other program's file
    with pytest.raises(RuntimeError, match=f"{path} is not a preemption checkpoint written "
                                           "by ts.PreemptionCheckpointHandler"):
        _handler(tmp_path)


def test_a_checkpoint_of_another_model_names_the_file_and_the_fix(tmp_path):
    old = nn.Linear(3, 1)
    write_atomically({"format": 1, "total_run_calls": 5, "num_replicas": 1, "rng": {},
                      "objects": {"model": old.state_dict()}, "global_batch_sizes": {}},
                     tmp_path / "preemption.pt")
    with pytest.raises(RuntimeError) as caught:
        _handler(tmp_path, {"model": nn.Linear(4, 1)})
    message = str(caught.value)
    assert message.startswith(f"The preemption checkpoint {tmp_path}/preemption.pt does not "
                              f"fit checkpoint['model'] (RuntimeError: Error(s) in loading "
                              f"state_dict for Linear; size mismatch for weight")
    assert message.endswith("it was written by another model or configuration. Delete it to "
                            "start afresh, or point the handler at this job's own "
                            "directory.")
    assert _handler(tmp_path, {"model": nn.Linear(3, 1)}).total_run_calls == 5


# -- two replicas: one outcome, failed saves, SIGTERM while waiting ------------------------

def _outcome(out, rank, what):
    with open(os.path.join(out, f"outcome{rank}"), "w") as f:
        f.write(what)


def _read_outcome(out, rank):
    with open(os.path.join(out, f"outcome{rank}")) as f:
        return f.read()


def _same_refusal(out):
    ts.MirroredStrategy()
    rank = dist.get_rank()
    directory = os.path.join(out, "shared")
    try:
        ts.PreemptionCheckpointHandler(None, {"counter": _Counter()}, directory)
    except Exception as error:
        _outcome(out, rank, f"{type(error).__name__}: {error}")
    dist.barrier()  # every replica got out of the constructor: none is left in a collective
    return rank


def test_every_replica_gets_the_chiefs_refusal(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    launch(_same_refusal, str(tmp_path), n=2)
    first, second = _read_outcome(tmp_path, 0), _read_outcome(tmp_path, 1)
    assert first == second
    assert first.startswith(f"PermissionError: PreemptionCheckpointHandler: checkpoint_dir "
                            f"{shared} is writable by every user (mode 777)")


def _signal_self(out):
    with open(os.path.join(out, "signalled"), "w") as f:
        f.write(str(time.time()))
    os.kill(os.getpid(), signal.SIGTERM)


class _Exited(BaseException):  # as SystemExit: not a step failure
    pass


def _train_until_it_ends(out, failure):
    """Two replicas step (one all-reduce each) under a handler; replica 1 gets SIGTERM at
    step 2. `failure`: "write" (the chief's directory becomes a file after the handler was
    made), "save_fn" (replica 1's save_fn raises) or "sigterm" (the chief's save_fn waits
    while replica 1, waiting for the chief, gets a second SIGTERM)."""
    ts.MirroredStrategy()
    rank = dist.get_rank()
    directory = os.path.join(out, "ckpt")

    def exit_fn():  # records when, then leaves the loop as sys.exit would
        _outcome(out, rank, f"exit {handler.total_run_calls} {time.time()}")
        raise _Exited

    def save_fn():
        if failure == "save_fn" and rank == 1:
            raise OSError(28, "No space left on device")
        if failure == "sigterm" and rank == 1:
            # Sent while this replica waits for the chief, as torchrun's agent would.
            threading.Timer(0.5, _signal_self, (out,)).start()
        if failure == "sigterm" and rank == 0:  # busy until replica 1 stopped waiting
            deadline = time.monotonic() + 30
            while not os.path.exists(os.path.join(out, "outcome1")) and \
                    time.monotonic() < deadline:
                time.sleep(0.02)

    handler = ts.PreemptionCheckpointHandler(
        None, {"counter": _Counter()}, directory, ts.TerminationConfig(
            exit_fn=exit_fn,
            save_fn=None if failure == "write" else save_fn))
    if failure == "write" and rank == 0:
        shutil.rmtree(directory)
        with open(directory, "w"):
            pass
    try:
        with handler.watch_preemption_scope():
            for step in range(40):
                if step == 2 and rank == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                handler.run(dist.all_reduce, torch.ones(1))
        _outcome(out, rank, "never stopped")
    except _Exited:
        pass
    except Exception as error:
        assert isinstance(error, PreemptionSaveError) and isinstance(error, RuntimeError)
        _outcome(out, rank, f"{type(error).__name__} {time.time()} {error}")
    return rank


@pytest.mark.parametrize("failure", ["write", "save_fn"])
def test_a_failed_save_ends_every_replica_at_once_with_the_reason(tmp_path, failure):
    launch(_train_until_it_ends, str(tmp_path), failure, n=2)
    outcomes = [_read_outcome(tmp_path, rank).split(" ", 2) for rank in range(2)]
    assert [kind for kind, _, _ in outcomes] == ["PreemptionSaveError"] * 2, outcomes
    reason = ("replica 0: FileExistsError" if failure == "write"
              else "replica 1: OSError: [Errno 28] No space left on device")
    for _, _, message in outcomes:
        # Replica 1 asked for the preemption before step 3: the save after step 3 failed.
        assert message.startswith(f"PreemptionCheckpointHandler: the preemption checkpoint "
                                  f"{tmp_path}/ckpt/preemption.pt was not saved after step "
                                  f"3: {reason}")
        assert "stops with this error instead of exiting for a restart" in message
    # The replica that did not fail saw the other's failure in the store, not at the
    # 60 s bound (the launch's collective timeout) of its wait.
    times = [float(when) for _, when, _ in outcomes]
    assert abs(times[0] - times[1]) < 30


def test_a_replica_waiting_for_the_chief_stops_waiting_on_sigterm(tmp_path):
    launch(_train_until_it_ends, str(tmp_path), "sigterm", n=2)
    first, second = (_read_outcome(tmp_path, rank).split() for rank in range(2))
    # Replica 1 stopped waiting when the signal came (0.5 s into its wait), well inside
    # the 30 s the chief's save_fn allows, and exited; the chief still wrote the
    # checkpoint of the agreed step afterwards.
    assert second[:2] == ["exit", "3"] and first[:2] == ["exit", "3"]
    signalled = float((tmp_path / "signalled").read_text())
    assert float(second[2]) - signalled < 10 and float(second[2]) < float(first[2])
    saved = torch.load(tmp_path / "ckpt" / "preemption.pt", weights_only=True)
    assert saved["total_run_calls"] == 3 and sorted(saved["rng"]) == [0, 1]


# -- visible without logging configuration -------------------------------------------------

_PLAIN_PROGRAM = textwrap.dedent("""
    import os, signal, sys
    import torchstrategy as ts

    class Counter:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    handler = ts.PreemptionCheckpointHandler(None, {"c": Counter()}, sys.argv[1])
    for step in range(10):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        handler.run(lambda: None)
""")


def test_the_handler_reports_on_stderr_without_logging_configuration(tmp_path):
    result = subprocess.run([sys.executable, "-c", _PLAIN_PROGRAM, str(tmp_path / "ckpt")],
                            env=plain_environment(), cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 42, result.stderr
    path = tmp_path / "ckpt" / "preemption.pt"
    assert [line for line in result.stderr.splitlines() if "torchstrategy" in line] == [
        "torchstrategy: termination notice (SIGTERM); a checkpoint will be saved at a step "
        "all replicas agree on.",
        "torchstrategy: replica 0: the replicas agreed to save the preemption checkpoint "
        "after step 3 (this replica has run 2).",
        f"torchstrategy: preemption checkpoint written to {path} after 3 steps.",
        "torchstrategy: replica 0: exiting with code 42 after the preemption checkpoint, for "
        "torchrun or the scheduler to restart the job."], result.stderr


def test_the_stderr_handler_gives_way_to_the_programs_logging(tmp_path, capsys,
                                                              monkeypatch):
    _handler(tmp_path)  # installs the handler (once per process)
    logger = logging.getLogger("torchstrategy")
    ours = [h for h in logger.handlers if isinstance(h, termination._StderrUnlessConfigured)]
    assert len(ours) == 1
    _handler(tmp_path)
    assert len([h for h in logger.handlers if h in ours or
                isinstance(h, termination._StderrUnlessConfigured)]) == 1
    # pytest's own handlers on the root logger count as the program's configuration.
    assert logging.getLogger().handlers
    logger.warning("torchstrategy: configured")
    assert "configured" not in capsys.readouterr().err
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    logger.warning("torchstrategy: not configured")
    logging.getLogger("torchstrategy.sub").warning("torchstrategy: a child logger")
    assert capsys.readouterr().err == ("torchstrategy: not configured\n"
                                       "torchstrategy: a child logger\n")
    logger.info("torchstrategy: below WARNING")
    assert capsys.readouterr().err == ""


# -- the other cryptic cases -----------------------------------------------------------------

def test_compute_average_loss_names_a_sample_weight_that_does_not_fit():
    loss = torch.tensor([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match=r"sample_weight of shape \[3\] does not fit "
                                         r"per_example_loss of shape \[4\].* It has 3 weights "
                                         r"for 4 examples: give this replica's weights"):
        ts.compute_average_loss(loss, sample_weight=torch.ones(3), global_batch_size=4)
    # [4, 1] against [4] would broadcast to a 4 x 4 product and sum 4 times too much.
    with pytest.raises(ValueError, match=r"shape \[4, 1\] does not fit .* write "
                                         r"sample_weight.reshape\(\[4\]\)"):
        ts.compute_average_loss(loss, sample_weight=torch.ones(4, 1), global_batch_size=4)
    with pytest.raises(ValueError, match=r"shape \[2\] does not fit per_example_loss of "
                                         r"shape \[2, 3\].* write sample_weight\[:, None\]"):
        ts.compute_average_loss(torch.ones(2, 3), sample_weight=torch.ones(2),
                                global_batch_size=2)
    weights = torch.tensor([1.0, 0.0, 2.0, 1.0])
    assert ts.compute_average_loss(loss, sample_weight=weights, global_batch_size=4).item() \
        == pytest.approx((1 + 6 + 4) / 4)
    assert ts.compute_average_loss(torch.ones(2, 3), sample_weight=torch.ones(2, 1),
                                   global_batch_size=2).item() == 3.0
    assert ts.compute_average_loss(loss, sample_weight=0.5, global_batch_size=4).item() == 1.25


def test_a_parameter_server_spec_with_two_tasks_on_one_address_is_refused_at_once():
    spec = ts.ClusterSpec({"chief": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"],
                           "ps": ["127.0.0.1:2223"]})
    resolver = ts.SimpleClusterResolver(spec, task_type="chief", task_id=0)
    # refused, not waited for: a wait would end in the join timeout's error, not this one
    with pytest.raises(ValueError, match="The cluster spec gives worker:0 and ps:0 the same "
                                         "address 127.0.0.1:2223: every task needs its own "
                                         "host:port"):
        ts.ParameterServerStrategy(resolver, startup_timeout=300)
    with pytest.raises(ValueError, match="the same address"):
        ts.Server(spec, job_name="ps", task_index=0)


_IDLE_LAUNCHER = textwrap.dedent("""
    import multiprocessing.util, os, sys, time
    import torchstrategy as ts
    from tests.helpers.processes import sleep_then_mark

    if __name__ == "__main__":
        print(multiprocessing.util.get_temp_dir(), flush=True)
        ts.launch(sleep_then_mark, sys.argv[1], 120, num_replicas=2, timeout_seconds=60)
""")


def test_a_launcher_ended_by_sigterm_leaves_no_replica_and_no_pymp_directory(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", _IDLE_LAUNCHER, str(tmp_path)],
                               env=plain_environment(), cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        temp_dir = process.stdout.readline().strip()
        assert temp_dir.startswith(os.path.join(os.path.dirname(temp_dir), "pymp-")), temp_dir
        deadline = time.monotonic() + 90
        while not (tmp_path / "sleeper.pid").exists():  # a replica runs: the parent idles
            assert process.poll() is None, process.communicate()[0]
            if time.monotonic() > deadline:  # a hang guard, not a speed check
                pytest.fail("ts.launch started no replica")
            time.sleep(0.05)
        replica = int((tmp_path / "sleeper.pid").read_text())
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGTERM, output  # ended by the signal, as before
    assert not os.path.exists(temp_dir), f"{temp_dir} was left behind"
    assert not alive(replica)
