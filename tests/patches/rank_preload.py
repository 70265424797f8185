"""What the ranks' fork server imports once, so that each spawned rank starts with it (``ranks.spawn_ranks``).

Every harness's rank imports torch, vLLM's config and its parallel state before anything else (about 8 s of a
rank's 9 s start on two cores). The fork server (``multiprocessing``'s ``forkserver``, one per test process)
imports them here once; each rank is forked from it, single-threaded and with nothing of the test process,
as a spawned one is. A module that fails to import here (a tree under test that does not compile) is left
for the rank to import again and fail on by itself, where ``ranks.fatal_report`` names whose failure it is.
"""

from __future__ import annotations

import importlib

MODULES = (
    "torch",
    "torch.distributed",
    "vllm",
    "vllm.config",
    "vllm.distributed.parallel_state",
    "vllm.model_executor.layers.mla",
)

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except BaseException:  # the rank imports it again and reports what it raises
        break
