"""torchrun for a reference program (a plain torch original, run only to be compared with):
the agent imports what every replica of the program imports, then forks its replicas from
itself (torchrun's own ``--run-path --start-method=fork``) instead of starting a Python
interpreter for each, so a reference launch costs one import of torch instead of three.

    python forking_agent.py MODULE[,MODULE...] TORCHRUN_ARGUMENTS... /abs/program.py ARGS...

Only for references: a forked replica ends without the interpreter's exit (no ``atexit``
handlers, no teardown), which is part of what a port's launch checks. The modules are
imported before torchrun starts its agent, so that nothing of torchrun's runs yet when they
are loaded; each must be one whose import has no effect the program could rely on.
"""
import importlib
import runpy
import sys

for name in sys.argv.pop(1).split(","):
    importlib.import_module(name)
runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
