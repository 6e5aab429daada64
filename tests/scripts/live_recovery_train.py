"""One replica of a job trained under live recovery (tests/reliability/test_live_recovery.py).

Started by the test as a launcher would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; rank 0 hosts the rendezvous store). Arguments: a JSON object
with ``out`` (a directory), ``steps``, ``global_batch``, ``min_replicas``,
``commit_every`` (optional, default 1), ``max_replicas`` and ``join`` (optional: the
job's store address for a process that joins it, started without a launcher's variables)
and ``kills``:
``[[rank, step, where], ...]``, where ``where`` is ``"backward"`` (SIGKILL between the
forward and the backward: the others wait in the gradient all-reduce) or ``"after_step"``
(SIGKILL after the optimizer stepped; with a commit every step, after the vote) or
``"break"`` (in an optimizer step pre-hook that runs before live recovery's, after the
gradient all-reduce completed everywhere: raises the error of a broken connection, as if
this replica's all-reduce had failed while the others' completed; the replica lives on) or
``"pause"`` (between the forward and the backward, writes ``out/paused<rank>`` and sleeps
``pause_seconds`` (optional, default 3): the test takes the replica's link down meanwhile)
or
``"before_step"`` (SIGKILL after the backward, before the optimizer step: the
gradient all-reduce completed everywhere, the others wait for its vote) or
``"after_vote"`` (SIGKILL in an optimizer step pre-hook that runs after live recovery's:
the replica voted, the step committed, its optimizer did not step) or ``"sigterm"`` (a
SIGTERM to itself during the step: it leaves the job at the next commit) or
``"abandon_open"`` (its step fails before its backward with the error of a broken
connection, and the group it abandons keeps its connections open: held, its sockets not
shut down, as when a closed end does not wake a gloo collective; the others, waiting in the
gradient all-reduce for it, can only learn from the store that it began the recovery);
``reduce_after_steps`` (optional): the steps whose function ends with an all-reduce of the
loss after the optimizer step (a collective after the commit); ``decay_steps``
(optional): the steps run by another step function, which multiplies the parameters by
`DECAY` before the optimizer step (a change live recovery cannot undo without a full copy:
it votes after that function's steps); ``hold_for_joiners`` (optional, ``[step, count]``):
the job's replicas wait before that step until `count` joiners wait for admission (so
that the step's commit admits them, whatever the joiners' start-up time: with step 0,
before any commit could admit one; each writes ``out/holding<rank>`` as it starts
waiting); ``die_during_admission`` (optional, for a joiner):
``"share"`` or ``"group"``, where it is SIGKILLed (see `_die_during_admission`);
``vote_every`` (optional, default 1), LiveRecovery's. Each
step also runs a
BatchNorm (``tracker``, given to LiveRecovery, not part of the model's output) whose
``num_batches_tracked`` counts the forward passes a replica kept: a step undone and
redone must count once. Each surviving replica writes ``out/rank<R>.json``: its final fp64
parameters, the recoveries, the step count, the tracker's count, the votes it cast.
"""
import json
import os
import signal
import sys
import time

import torch

import torchstrategy as ts
from torchstrategy import _compat, runtime
from torchstrategy.launch import sockets
from torchstrategy.fault_tolerance.live_recovery import LiveRecovery
from torchstrategy.fault_tolerance.step_commit import StepCommit


def data(steps, global_batch):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * global_batch, 4, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + 0.1
    return x, y


DECAY = 0.99


def decay(model):
    """Weight decay by hand, before the optimizer step (``decay_steps``)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(DECAY)


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 1)).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _die_during_admission(where):
    """A joiner SIGKILLed during its admission: ``"share"``, in the group of the members and
    the joiners, as replica 0 starts sending it the state; ``"group"``, registered among
    the survivors, as the new group is being built."""
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "share":
        LiveRecovery._share_state = die
    else:
        type(runtime.current()).regroup = die


def main(config):
    if config.get("join") and config.get("die_during_admission"):
        _die_during_admission(config["die_during_admission"])
    strategy = ts.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model, optimizer = model_and_optimizer()
    # Made outside the scope: its buffers stay this replica's own (a BatchNorm made inside
    # is averaged over the replicas after each step, a collective after the optimizer step
    # that would move where the tests' kills break a step).
    tracker = torch.nn.BatchNorm1d(4, affine=False).double()
    kills = {(r, s): where for r, s, where in config["kills"]}
    steps_run = [0]
    first_rank = int(os.environ.get("RANK", -1))   # RANK changes when the replicas regroup

    def break_before_vote(optimizer, args, kwargs):
        # Registered before LiveRecovery's pre-hook, after the strategy's (the gradients
        # are summed everywhere): this replica's step fails, the others' completes.
        if kills.get((first_rank, steps_run[0])) == "break":
            kills.pop((first_rank, steps_run[0]))
            raise RuntimeError("Connection closed by peer (simulated: this replica's "
                               "all-reduce broke after the others' completed)")

    optimizer.register_step_pre_hook(break_before_vote)
    votes = [0]
    decide = StepCommit.decide

    def counted(commit, *args, **kwargs):
        votes[0] += 1
        return decide(commit, *args, **kwargs)

    StepCommit.decide = counted
    recovery = LiveRecovery(strategy, {"model": model, "optimizer": optimizer,
                                       "tracker": tracker},
                            global_batch_size=config["global_batch"],
                            min_replicas=config["min_replicas"],
                            failure_detection_seconds=2.0,
                            recovery_timeout_seconds=config.get("recovery_timeout", 30.0),
                            commit_every=config.get("commit_every", 1),
                            vote_every=config.get("vote_every", 1),
                            leave_on_signals=(signal.SIGTERM,),
                            max_replicas=config.get("max_replicas"),
                            join=tuple(config["join"]) if config.get("join") else None)
    rank = recovery.uid
    x, y = data(config["steps"], config["global_batch"])
    g = config["global_batch"]
    replicas_per_step = []
    reduce_after = set(config.get("reduce_after_steps", ()))
    decay_steps = set(config.get("decay_steps", ()))

    def kill_after_vote(optimizer, args, kwargs):
        # Runs after live recovery's pre-hook (registered after it): the vote is in.
        if kills.get((rank, recovery.step)) == "after_vote":
            os.kill(os.getpid(), signal.SIGKILL)

    optimizer.register_step_pre_hook(kill_after_vote)

    held_groups = []   # "abandon_open": the abandoned group, kept alive until the end

    def train_step(batch):
        xb, yb = batch
        where = kills.get((rank, recovery.step))
        tracker(xb)
        per_example = (model(xb) - yb).pow(2).squeeze(1)
        loss = ts.compute_average_loss(per_example, global_batch_size=g)
        if where == "backward":
            os.kill(os.getpid(), signal.SIGKILL)
        if where == "abandon_open":
            kills.pop((rank, recovery.step))
            held_groups.append(_compat.default_process_group())
            sockets.shut_down = lambda inodes: 0
            raise RuntimeError("Connection closed by peer (simulated: this replica's step "
                               "failed before its all-reduce; its connections stay open)")
        if where == "pause":
            with open(os.path.join(config["out"], f"paused{rank}"), "w"):
                pass
            time.sleep(config.get("pause_seconds", 3))
        loss.backward()
        if where == "sigterm":     # a termination notice: leave at the next commit
            os.kill(os.getpid(), signal.SIGTERM)
        if where == "before_step":
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()
        optimizer.zero_grad()
        if where == "after_step":
            os.kill(os.getpid(), signal.SIGKILL)
        if recovery.step in reduce_after:
            return ts.get_replica_context().all_reduce("sum", loss.detach())
        return loss.detach()

    def decayed_step(batch):
        decay(model)
        return train_step(batch)

    hold_step, hold_count = config.get("hold_for_joiners") or (None, 0)
    while recovery.step < config["steps"]:
        s = recovery.step
        if s == hold_step and not config.get("join"):
            with open(os.path.join(config["out"], f"holding{rank}"), "w"):
                pass   # a test may start the joiner now: it is admitted at this step's commit
            deadline = time.monotonic() + 60
            while recovery.joiners_waiting < hold_count:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {hold_count} joiner(s) asked to join in 60 s")
                time.sleep(0.02)
        steps_run[0] = s
        recovery.run(decayed_step if s in decay_steps else train_step,
                     (x[s * g:(s + 1) * g], y[s * g:(s + 1) * g]))
        replicas_per_step.append(recovery.num_replicas)
    recovery.commit()
    held_groups.clear()
    result = {"params": [p.detach().tolist() for p in model.parameters()],
              "steps": recovery.step, "replicas_per_step": replicas_per_step,
              "tracked": int(tracker.num_batches_tracked),
              "recoveries": [[r.step, list(r.lost), r.replicas, r.seconds, r.planned]
                             for r in recovery.recoveries],
              "votes": votes[0]}
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def replica(environment, config, log_path):
    """The same replica in a process forked by the test's fork server (torch already
    imported there): `environment` is the launcher's variables, the output goes to
    `log_path`; the runtime's shutdown, which a forked child does not run at exit, runs
    here."""
    for name in ("TORCHELASTIC_RUN_ID", "TORCHSTRATEGY_LAUNCHER", "TORCHSTRATEGY_PARENT_PID",
                 "TORCHSTRATEGY_PUBLISHED_WORLD", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # The test's own launcher, if any, or a strategy the test process made (which
        # publishes its world here) is not this job's: a joiner must see none of it.
        os.environ.pop(name, None)
    os.environ.update(environment)
    torch.set_num_threads(1)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    try:
        main(config)
    finally:
        runtime.current().shutdown()
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
