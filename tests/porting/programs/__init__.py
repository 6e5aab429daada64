"""Original DDP/FSDP2 programs, small, that docs/porting_from_ddp.md's diffs port (fixtures)."""
