"""A re-executed job in which one replica fails (issue 36, items 8 and 9):
`python failing_replica.py MODE`.

MODE:
  sharded_keyerror   ShardedStrategy; replica 1 raises KeyError at its second step while
                     replica 0 goes on into FSDP2's collectives.
  init_fn_raises     ShardedStrategy(init_fn=...) on a model built on meta; the function
                     raises on replica 1 only.
"""
import sys

import torch

import torchstrategy as ts

mode = sys.argv[1]


def init_fn(module):
    if strategy.extended.replica_id == 1:
        raise ValueError("init_fn fails on replica 1 on purpose")
    module.reset_parameters()


if mode == "sharded_keyerror":
    strategy = ts.ShardedStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rid = strategy.extended.replica_id
    for step in range(4):
        if step == 1 and rid == 1:
            {}["learning_rate"]   # a KeyError on one replica
        strategy.run(lambda: model(torch.ones(4, 8)).sum().backward())
        optimizer.step()
        optimizer.zero_grad()
elif mode == "init_fn_raises":
    strategy = ts.ShardedStrategy(devices=["cpu:0", "cpu:1"], init_fn=init_fn)
    with strategy.scope():
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    strategy.run(lambda: model(torch.ones(4, 8)).sum().backward())
else:
    raise SystemExit(f"unknown mode {mode!r}")
