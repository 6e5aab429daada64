"""The parts of `ShardedStrategy` (strategies/sharded.py): its parameter handling
(`parameters`: when and how models are sharded), which modules become FSDP2 units (`plan`),
optimizers built before sharding (`stale`), and the sharded state outside the modules:
checkpoints and the export of a plain state_dict (`state`)."""
