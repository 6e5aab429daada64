"""Every checkpoint path under every strategy (issue 24, item 4): ``ts.checkpoint`` (through
the strategy's ``state_dict_for_checkpoint`` / ``load_state_dict_from_checkpoint``),
``ts.BackupAndRestore`` and ``ts.PreemptionCheckpointHandler`` (a real SIGTERM on replica 0,
the agreed save, exit_fn), each under MirroredStrategy, MultiWorkerMirroredStrategy and
ShardedStrategy, trained with Adam in fp64 on 2 gloo replicas, interrupted after 3 of 6
steps, and resumed in fresh processes on 2 and on 3 replicas from freshly seeded (wrong)
weights: the final weights and every Adam state (step, exp_avg, exp_avg_sq) equal one
device's uninterrupted run to 1e-6.

One launch saves all nine cells, one launch per replica count resumes them all
(tests/sharded/checkpoint_matrix.py). Lightning checkpoints are in
tests/sharded/test_lightning_sharded.py and tests/lightning/.
"""
import pytest
import torch

import torchstrategy as ts
from tests.sharded import checkpoint_matrix as matrix

LAUNCH_TIMEOUT = 120
pytestmark = pytest.mark.timeout(4 * LAUNCH_TIMEOUT)

CELLS = [(strategy, path) for strategy in matrix.STRATEGIES for path in matrix.PATHS]
TOLERANCE = 1e-6


def _launch(fn, *args, n):
    return ts.launch(fn, *args, num_replicas=n, timeout_seconds=LAUNCH_TIMEOUT)


def test_every_checkpoint_path_under_every_strategy_resumes_exactly(tmp_path):
    root = str(tmp_path)
    assert _launch(matrix.save_all, root, CELLS, n=2) is True
    weights, adam = matrix.reference()
    failures = []
    for replicas in (2, 3):
        results = _launch(matrix.resume_all, root, CELLS, n=replicas)
        for cell in CELLS:
            result = results[cell]
            where = f"{cell[0]} / {cell[1]}, saved on 2 replicas, resumed on {replicas}"
            if isinstance(result, str):
                failures.append(f"{where}: {result}")
                continue
            got_weights, got_adam = result
            assert list(got_weights) == list(weights), where
            assert sorted(got_adam) == sorted(adam), where
            for key, value in weights.items():
                torch.testing.assert_close(got_weights[key], value, atol=TOLERANCE, rtol=0,
                                           msg=lambda m: f"{where}, weight {key}: {m}")
            for name, state in adam.items():
                assert sorted(got_adam[name]) == ["exp_avg", "exp_avg_sq", "step"], where
                for key, value in state.items():
                    torch.testing.assert_close(
                        got_adam[name][key], value, atol=TOLERANCE, rtol=0,
                        msg=lambda m: f"{where}, Adam {key} of {name}: {m}")
    assert not failures, "\n".join(failures)
