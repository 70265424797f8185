"""The command line's verbs, one module per job, each verb's options beside its handler.

Every module here has ``configure_parser(sub)``: it adds its verbs to the ``overlay`` sub-parsers
and sets ``handler`` on each (the pattern of auditwheel's ``main_<verb>.py``). ``overlay.cli``
only builds the parser from :data:`MODULES` and dispatches.

A new verb is one function in one of these modules (or a new module named in :data:`MODULES`), its
line in the table below, and:

- its Make target of the same name, ``<verb>: $(TOOL_STAMP) ## help [VARS]`` calling
  ``$(OVERLAY) <verb>`` (a bare ``$(call q,PYTHON) -m overlay <verb>`` and no stamp only for a verb
  of :data:`DEVICE_VERBS`), on a ``.PHONY`` line: the Makefile's header says it, and
  ``tests/test_commands.py`` holds the table, the header and the recipes;
- its row in the README's "Make targets" table (``tests/test_readme.py``: every target ``make help``
  lists has one; a target's name is letters, digits, ``_`` and ``-``);
- a new module also in ``docs/ARCHITECTURE.md``'s Layout row ``overlay/commands/`` (``tests/test_package_layout.py``).

These modules import only the standard library at import time, and so does building the parser
(``tests/test_commands.py`` imports each in a fresh interpreter and looks): the library behind a
verb is imported inside its handler, so a verb of :data:`DEVICE_VERBS` runs on the GPU device
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
- ``engine.py``: engine-check, engine-variants, engine-checkpoint, engine-plot, liveness-lines
- ``kernels.py``: kernel-sources, kernel-toolchain, kernels
"""

from __future__ import annotations

# in `overlay --help` order
MODULES: tuple[str, ...] = (
    "build", "series", "workspace_plan", "bench", "image", "regress", "rebase", "checks", "device", "engine", "kernels",
)

DEVICE_VERBS: tuple[str, ...] = ("engine-check", "engine-checkpoint", "bench-engine")
"""The verbs whose Make targets run on the GPU device machine, which has neither a venv nor a network:
their recipes call a bare ``$(call q,PYTHON) -m overlay <verb>`` and depend on no stamp (making the
venv needs the network); every other verb's target calls ``$(OVERLAY)``, the venv's. The one list: the
Makefile's header names it, and ``tests/test_commands.py`` holds the header and the recipes to it.

It is about Make targets only. A script that runs on the device under ``scripts/device-run.sh``
(the carries unpacked, the staged vLLM and its requirements on ``PYTHONPATH``) calls
``python3 -m overlay <verb>`` itself, for any verb whose handler's imports the carries hold:
``scripts/device-regress.sh`` judges its runs with ``regress-verdicts``, whose own target (run where
the reports are) keeps ``$(OVERLAY)``.
"""
