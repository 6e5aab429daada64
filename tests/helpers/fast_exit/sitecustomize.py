"""Imported at start-up by every Python process the test suite starts (tests/conftest.py puts
this directory first on ``PYTHONPATH``): the cyclic garbage collector's last passes, at
interpreter exit, skip the objects alive then.

Why: a process that imported torch, torch._dynamo and torchstrategy spends 1.2-1.5 s of CPU
at exit on the collector walking its whole heap (measured on the 2-core CI machine: a
process that only imports them costs 8.0-8.3 s of CPU in all, 6.0 s with this), memory the
operating system takes back anyway. The suite starts hundreds of such processes.

What it changes: after every exit handler has run (this one is registered first, so it runs
last), objects kept alive by reference cycles are no longer collected, so their ``__del__``
does not run at exit. Python does not promise that it does; everything else of the exit
(exit handlers, weakref finalizers, the teardown of modules, threads, flushing) is
unchanged. The test files about exit itself run without it (the ``real_exit`` fixture in
tests/conftest.py), as does any run with ``TORCHSTRATEGY_TESTS_REAL_EXIT=1``.
"""
import atexit
import gc

atexit.register(gc.freeze)
