"""How replicas come to exist: torchrun, re-execution of ``python train.py``, `ts.launch`."""
