"""``make regress``: the checks of :data:`overlay.regress.checks.CHECKS` (differential against a
reference, long context, GSM8K, latency, speculative-decoding acceptance, in that order) of a
served build against a profile's stored baselines, with a report people read.

Modules: ``checks`` (the one registry of the checks), ``profiles`` (validated YAML), ``server``
(launch or attach, readiness, death), ``client`` (the OpenAI-compatible HTTP calls),
``textchecks`` (answer parsing, repetition), ``differential``, ``longctx``, ``gsm8k``,
``latency``, ``acceptance`` (one check each), ``reference`` (the differential reference's schema),
``results`` (findings and verdict), ``plots`` and ``report`` (the report folder),
``baseline_record`` (``--record-baseline``), ``runner`` (coordinates a run), ``verdicts``
(``make regress-verdicts``), ``errors``, ``workspace_plan`` (``make workspace-plan``).
"""
