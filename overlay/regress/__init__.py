"""``make regress``: a served build judged against a profile's stored baselines, with a report people
read.

Which checks run, in which order, and where each one's code lives: :data:`overlay.regress.checks.CHECKS`,
the one registry (its docstring says why that order and what adding a check touches). The package's
modules, one line each: ``docs/ARCHITECTURE.md``'s Layout row ``overlay/regress/`` (``tests/test_package_layout.py``
holds it to this folder). Neither is repeated here (``tests/regress/test_checks_registry.py``).
"""
