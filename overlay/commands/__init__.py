"""The command line's verbs, one module per job, each verb's options beside its handler.

Every module here has ``configure_parser(sub)``: it adds its verbs to the ``overlay`` sub-parsers
and sets ``handler`` on each (the pattern of auditwheel's ``main_<verb>.py``). ``overlay.cli``
only builds the parser from :data:`MODULES` and dispatches. A new verb is one function in one of
these modules (or a new module named in :data:`MODULES`), plus its Make target.

These modules import only the standard library at import time: the library behind a verb is
imported inside its handler, so ``python3 -m overlay engine-check`` runs on the GPU device machine,
which has no venv.
"""

from __future__ import annotations

# in `overlay --help` order
MODULES: tuple[str, ...] = (
    "build", "series", "workspace_plan", "bench", "image", "regress", "rebase", "checks", "device", "engine", "kernels",
)
