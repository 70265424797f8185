"""What the tools key by vLLM release, in one place: GLM-5's model class, attention class and DCP entry,
the default model runner, the DCP defaults GLM-5 gets, where the DCP ops live and what the direct-A2A switch
turns off (:class:`overlay.releases.facts.ReleaseFacts`).

Each fact is read from the release's own tree where it can be (``derive``: the registry line, the CUDA
branch of the model's module, ``envs.py``, the config classes); ``table`` holds the one thing the tree
cannot say (which attention class a model class builds and where it enters its DCP section), each entry
with its evidence. A release the two cannot describe is refused in one line naming what is missing
(:class:`overlay.releases.facts.ReleaseFactsError`). ``source`` reads a tree: a folder holding ``vllm/``
or a wheel. Standard library only: the engine check reads the facts on the GPU device.
"""
