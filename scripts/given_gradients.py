"""`GivenGradients`: a loss whose backward hands out precomputed gradients, for the
benchmarks that time gradient synchronisation without any model compute
(bench_allreduce.py, bench_cluster.py, bench_network.py import it: scripts/ is on their
sys.path when run as ``python scripts/NAME.py``)."""
import torch


class GivenGradients(torch.autograd.Function):
    """``GivenGradients.apply(grads, *params)`` returns a zero scalar; its backward gives
    each of ``params`` a fresh copy of the matching tensor of ``grads``."""

    @staticmethod
    def forward(ctx, grads, *params):
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return (None,) + tuple(g.clone() for g in ctx.grads)
