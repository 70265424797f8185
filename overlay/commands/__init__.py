"""The command line's verbs, one module per job, each verb's options beside its handler.

Every module here has ``configure_parser(sub)``: it adds its verbs to the ``overlay`` sub-parsers
and sets ``handler`` on each (the pattern of auditwheel's ``main_<verb>.py``). ``overlay.cli``
only builds the parser from :data:`MODULES` and dispatches. A new verb is one function in one of
these modules (or a new module named in :data:`MODULES`), plus its Make target.

These modules import only the standard library at import time, and so does building the parser
(``tests/test_commands.py`` imports each in a fresh interpreter and looks): the library behind a
verb is imported inside its handler, so ``python3 -m overlay engine-check`` runs on the GPU device
machine, which has no venv. A handler reports a refusal by raising :class:`overlay.errors.OverlayError`
(its ``exit_code`` is the status): ``overlay.cli`` alone prints ``error: ...``.

Where each verb lives (``tests/test_commands.py`` holds this table to the parser):

- ``build.py``: build
- ``series.py``: status, workspace, export
- ``workspace_plan.py``: workspace-plan
- ``bench.py``: bench-build, bench-merge, bench-engine
- ``image.py``: image, image-smoke
- ``regress.py``: regress, regress-verdicts
- ``rebase.py``: rebase, rebase-continue, cherry-pick, patch-tests-matrix
- ``checks.py``: upstream-tests, patch-lint
- ``device.py``: device-stage
- ``engine.py``: engine-check, engine-variants, engine-checkpoint, engine-plot
- ``kernels.py``: kernel-sources, kernel-toolchain, kernels
"""

from __future__ import annotations

# in `overlay --help` order
MODULES: tuple[str, ...] = (
    "build", "series", "workspace_plan", "bench", "image", "regress", "rebase", "checks", "device", "engine", "kernels",
)
