"""PreemptionCheckpointHandler with real processes: a SIGTERM to one of two replicas under
torchrun, a restart on three replicas, and (in this process) the save's atomicity, the
grace period and the argument checks."""
import datetime
import os
import signal
import time
import types

import pytest
import torch
import torch.distributed as dist

import torchstrategy as ts
from torchstrategy.backup_and_restore import check_resize
from torchstrategy.fault_tolerance import preemption, termination
from torchstrategy.fault_tolerance.agreement import StoreAgreement
from tests.fault_tolerance import runs

pytestmark = pytest.mark.timeout(300)

STEPS_PER_EPOCH = runs.preemption_train.SAMPLES // runs.preemption_train.GLOBAL_BATCH
TOTAL_STEPS = STEPS_PER_EPOCH * runs.preemption_train.EPOCHS


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return runs.reference(tmp_path_factory.mktemp("reference"))


def _check_training(out, nproc_by_attempt, uninterrupted):
    """Every step ran once on every replica, the global batches are the uninterrupted run's
    (so every sample is seen once per epoch), and the final parameters are its too."""
    weights, batches = uninterrupted
    logs = runs.read_logs(out, nproc_by_attempt)
    steps = sorted(step for _, step in logs)
    assert steps == list(range(1, TOTAL_STEPS + 1))
    seen = [sum(logs[key], []) for key in sorted(logs, key=lambda key: key[1])]
    assert seen == batches
    for epoch in range(runs.preemption_train.EPOCHS):
        epoch_samples = sum(seen[epoch * STEPS_PER_EPOCH:(epoch + 1) * STEPS_PER_EPOCH], [])
        assert sorted(epoch_samples) == list(range(runs.preemption_train.SAMPLES))
    final = torch.load(os.path.join(out, "final.pt"), weights_only=True)
    for name in weights:
        torch.testing.assert_close(final[name], weights[name], rtol=0, atol=1e-6)
    return logs


def _agreed_step(out):
    return torch.load(os.path.join(out, "ckpt", "preemption.pt"),
                      weights_only=True)["total_run_calls"]


def test_sigterm_to_one_replica_saves_once_and_torchrun_resumes(tmp_path, uninterrupted):
    process = runs.start_torchrun(tmp_path, nproc=2, max_restarts=1, slow=0.2)
    runs.signal_after(process, tmp_path, rank=1, steps=2)
    code, output = runs.finish(process)
    assert code == 0, output[-4000:]
    logs = _check_training(tmp_path, [2, 2], uninterrupted)
    agreed = _agreed_step(tmp_path)
    # Mid-epoch; both replicas stopped after the agreed step, the restart went on from it.
    assert 2 < agreed < STEPS_PER_EPOCH
    for rank in range(2):
        assert runs.steps_logged(tmp_path, rank, attempt=0) == agreed
        assert runs.steps_logged(tmp_path, rank, attempt=1) == TOTAL_STEPS - agreed
    assert sorted(step for attempt, step in logs if attempt == 1)[0] == agreed + 1
    assert output.count("preemption checkpoint written") == 1, output[-4000:]
    assert "exitcode: 42" in output
    assert "restored the preemption checkpoint" in output


def test_two_replicas_stopped_mid_epoch_resume_on_three(tmp_path, uninterrupted):
    first = runs.start_torchrun(tmp_path, nproc=2, max_restarts=0, slow=0.2)
    runs.signal_after(first, tmp_path, rank=1, steps=2)
    code, output = runs.finish(first)
    assert code != 0 and "exitcode: 42" in output, output[-4000:]
    agreed = _agreed_step(tmp_path)
    assert 2 < agreed < STEPS_PER_EPOCH
    second = runs.start_torchrun(tmp_path, nproc=3, max_restarts=0, launch=1)
    code, output = runs.finish(second)
    assert code == 0, output[-4000:]
    assert "written by 2 replicas, on 3 replicas" in output
    logs = _check_training(tmp_path, [2, 3], uninterrupted)
    # The same global batch of 6: 3 samples per replica before, 2 after the resize.
    for (attempt, step), slices in logs.items():
        assert [len(s) for s in slices] == ([3, 3] if attempt == 0 else [2, 2, 2])
        assert (attempt == 0) == (step <= agreed)


def test_backup_and_restore_written_by_three_replicas_resumes_on_two(tmp_path, uninterrupted):
    first = runs.start_torchrun(tmp_path, nproc=3, max_restarts=0, backup_until=5)
    code, output = runs.finish(first)
    assert code != 0 and "exitcode: 42" in output, output[-4000:]
    second = runs.start_torchrun(tmp_path, nproc=2, max_restarts=0, launch=1, backup_until=5)
    code, output = runs.finish(second)
    assert code == 0, output[-4000:]
    assert "written by 3 replicas, on 2 replicas" in output
    logs = _check_training(tmp_path, [3, 2], uninterrupted)
    for (attempt, step), slices in logs.items():
        assert [len(s) for s in slices] == ([2, 2, 2] if attempt == 0 else [3, 3])
        assert (attempt == 0) == (step <= 5)


def test_resize_refuses_a_global_batch_that_does_not_divide():
    check_resize(2, 3, {"data": (6, 6)}, "The checkpoint")
    with pytest.raises(ValueError, match=r"by 2 replicas and resumes on 4.*global batch of "
                                         r"data \(6 samples\) does not divide into 4"):
        check_resize(2, 4, {"data": (6, 6)}, "The checkpoint")
    with pytest.raises(ValueError, match=r"global batch of 6 samples for data, but this "
                                         r"run's loader gives global batches of 12"):
        check_resize(2, 2, {"data": (6, 12)}, "The checkpoint")


class _Counter:
    """A checkpointed object; `on_save` runs while the checkpoint is being written."""

    def __init__(self, on_save=None):
        self.value = torch.zeros(())
        self.on_save = on_save

    def state_dict(self):
        if self.on_save is not None:
            self.on_save()
        return {"value": self.value.clone()}

    def load_state_dict(self, state):
        self.value = state["value"].clone()


class _Unpicklable:
    def __reduce_ex__(self, protocol):
        raise KeyboardInterrupt("killed while writing")


def test_second_signal_during_the_save_and_a_killed_save_keep_the_last_checkpoint(tmp_path):
    exits = []
    config = ts.TerminationConfig(exit_fn=lambda: exits.append("exit"))
    counter = _Counter(on_save=lambda: os.kill(os.getpid(), signal.SIGTERM))
    previous = signal.getsignal(signal.SIGTERM)
    handler = ts.PreemptionCheckpointHandler(None, {"counter": counter}, tmp_path, config)
    with handler.watch_preemption_scope():
        for step in range(6):
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            handler.run(lambda: counter.value.add_(1))
    assert signal.getsignal(signal.SIGTERM) == previous  # the scope put it back
    # Noticed before step 3 ran: agreed on 3 steps, saved once (the second SIGTERM, sent
    # while saving, was only recorded), exit_fn called once, and training went on.
    assert exits == ["exit"] and handler._watcher.signals_received == 2
    assert torch.load(handler.path, weights_only=True)["total_run_calls"] == 3
    assert counter.value.item() == 6

    # A save killed while writing leaves the checkpoint of step 3 and only a temporary.
    counter2 = _Counter()
    resumed = ts.PreemptionCheckpointHandler(None, {"counter": counter2}, tmp_path, config)
    assert resumed.total_run_calls == 3 and counter2.value.item() == 3
    counter2.state_dict = lambda: {"value": _Unpicklable()}
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with resumed.watch_preemption_scope():
            for _ in range(3):
                resumed.run(lambda: None)
    assert torch.load(resumed.path, weights_only=True)["total_run_calls"] == 3
    stale = tmp_path / ".tmp-killed.pt"
    stale.write_bytes(b"partial")
    again = ts.PreemptionCheckpointHandler(None, {"counter": _Counter()}, tmp_path, config)
    again._watcher.stop()
    assert again.total_run_calls == 3 and not stale.exists()


class _Clock:
    """A monotonic clock that moves only when a step says so: the grace period's countdown
    is then exact, whatever else the machine is doing."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_grace_period_saves_then_trains_on_and_saves_before_it_ends(tmp_path, caplog,
                                                                    monkeypatch):
    # Steps of 1/8 s and saves of no time, on a clock only the steps move: the handler
    # must keep (two steps + one save) * 3 = 0.75 s of the 8 s grace period unused
    # (TerminationConfig's documented margin), so its last agreed step is the first one
    # started at or after 7.25 s: 58 steps after the notice.
    clock = _Clock()
    fake_time = types.SimpleNamespace(monotonic=clock.monotonic, sleep=time.sleep)
    monkeypatch.setattr(preemption, "time", fake_time)
    monkeypatch.setattr(termination, "time", fake_time)
    step, grace, steps_before_notice = 0.125, 8.0, 5
    exits = []
    config = ts.TerminationConfig(
        exit_fn=lambda: exits.append((handler.total_run_calls, clock.now)),
        grace_period=grace, signals=[signal.SIGUSR1])
    handler = ts.PreemptionCheckpointHandler(None, {"counter": _Counter()}, tmp_path, config)
    with handler.watch_preemption_scope():
        for _ in range(steps_before_notice):
            handler.run(clock.advance, step)
        os.kill(os.getpid(), signal.SIGUSR1)
        notice = handler._watcher.notice_time
        assert notice == clock.now
        for _ in range(int(2 * grace / step)):   # twice the grace period: a bound, not a wait
            if exits:
                break
            handler.run(clock.advance, step)
    last_step = steps_before_notice + 59
    assert exits == [(last_step, notice + 59 * step)]
    assert notice + grace - 3 * 2 * step <= exits[0][1] < notice + grace
    saves = [r for r in caplog.records if "preemption checkpoint written" in r.getMessage()]
    # The first agreed step (the one after the notice), then the last one before the end.
    assert [r.getMessage().rsplit("after ", 1)[1] for r in saves] == \
        [f"{steps_before_notice + 1} steps.", f"{last_step} steps."]
    assert torch.load(handler.path, weights_only=True)["total_run_calls"] == last_step


def test_save_fn_replaces_the_write_and_gets_the_arguments(tmp_path):
    calls = []
    config = ts.TerminationConfig(save_fn=lambda *args, **kwargs: calls.append((args, kwargs)),
                                  exit_fn=lambda: calls.append("exit"))
    counter = _Counter()
    handler = ts.PreemptionCheckpointHandler(None, {"counter": counter}, tmp_path, config)
    with handler.watch_preemption_scope():
        for step in range(5):
            counter.value.add_(1)
            if step == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            handler.save_checkpoint_if_preempted(step, tag="x")
    # The notice came after step 2; the agreed step is 3: save_fn saw step 2 (0-based).
    assert calls == [((2,), {"tag": "x"}), "exit"]
    assert torch.load(handler.path, weights_only=True)["objects"] is None
    resumed = ts.PreemptionCheckpointHandler(None, {"counter": _Counter()}, tmp_path, config)
    resumed._watcher.stop()
    assert resumed.total_run_calls == 3


def test_arguments_are_checked(tmp_path):
    with pytest.raises(TypeError, match="checkpoint must be a dict"):
        ts.PreemptionCheckpointHandler(None, object(), tmp_path)
    with pytest.raises(TypeError, match=r"checkpoint\['x'\]=.* has no state_dict"):
        ts.PreemptionCheckpointHandler(None, {"x": 1}, tmp_path)
    with pytest.raises(TypeError, match="cluster_resolver must be"):
        ts.PreemptionCheckpointHandler("worker", {}, tmp_path)
    with pytest.raises(ValueError, match="grace_period must be a number of seconds >= 0"):
        ts.TerminationConfig(grace_period=-1)
    with pytest.raises(ValueError, match="signals must be catchable signals"):
        ts.TerminationConfig(signals=[signal.SIGKILL])
    with pytest.raises(TypeError, match="exit_fn must be callable"):
        ts.TerminationConfig(exit_fn=42)
    handler = ts.PreemptionCheckpointHandler(None, {}, tmp_path)
    with handler.watch_preemption_scope():
        with pytest.raises(TypeError, match="no save_fn|there is none"):
            handler.save_checkpoint_if_preempted(1)


def test_store_agreement_first_claim_leads_and_waits_are_bounded():
    """Two replicas' view of the protocol over one real TCPStore (no process group)."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    chief, other = (StoreAgreement(dist.TCPStore("127.0.0.1", server.port, 1, False), "n1",
                                   rank, 2) for rank in range(2))
    assert other.claim() and not chief.claim()  # both got a notice: the first claim leads
    assert chief.agreed(0) is None
    other.publish(0, 7, final=True)
    assert chief.agreed(0) == (7, True) and other.agreed(0) == (7, True)
    assert StoreAgreement(server, "n2", 0, 2).agreed(0) is None  # another job's keys
    # The chief collects what was offered; a replica that offers nothing is left out after
    # the bound instead of hanging the save.
    chief.offer_rng(0, {"torch": torch.arange(3)})
    states = chief.collect_rng(0, timeout_seconds=0.2)
    assert list(states) == [0] and torch.equal(states[0]["torch"], torch.arange(3))
    assert not other.wait_saved(0, timeout_seconds=0.2)
    chief.mark_saved(0)
    assert other.wait_saved(0, timeout_seconds=5)
    # The first failure is the one every replica reports.
    assert other.report_error("replica 1: ValueError: bad") == "replica 1: ValueError: bad"
    assert chief.report_error("replica 0: CollectiveError") == "replica 1: ValueError: bad"
