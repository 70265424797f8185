"""``make regress``: GSM8K, long-context, speculative-decoding acceptance and latency of a served
build against a profile's stored baselines, with a report people read.

Modules: ``profiles`` (validated YAML), ``server`` (launch or attach, readiness, death),
``client`` (the OpenAI-compatible HTTP calls), ``textchecks`` (answer parsing, repetition),
``longctx``, ``gsm8k``, ``acceptance``, ``latency`` (one check each), ``results`` (findings and
verdict), ``plots`` and ``report`` (the report folder), ``runner`` (coordinates a run).
"""
