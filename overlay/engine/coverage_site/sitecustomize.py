"""engine-check --coverage: start coverage.py in every Python process of a job (first on its PYTHONPATH).

``coverage.process_startup()`` starts measuring when ``COVERAGE_PROCESS_START`` names an rc file (the job's,
``overlay/engine/liveness_run.py``) and does nothing otherwise, or when it already ran in this process.
The ``sitecustomize`` this one shadows, if any further on ``sys.path``, still runs.
"""

import importlib.machinery
import importlib.util
import os
import sys

try:
    import coverage
except ImportError:  # the check refuses --coverage where coverage.py is missing: nothing to do here
    pass
else:
    coverage.process_startup()

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
if _spec is not None and _spec.loader is not None:
    _shadowed = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_shadowed)
