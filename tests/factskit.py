"""Small synthetic vLLM trees for the release facts: only the files ``overlay.releases.derive`` reads, in
the shapes the real releases have them (a registry line, a model module's CUDA branch, ``envs.py``'s
table, ``VllmConfig.use_v2_model_runner``, ``ParallelConfig``'s DCP fields, GLM-5's config hook).

:data:`SHAPES` names the shape of each release read so far; ``tests/test_release_facts.py`` holds each to
the facts of the real tree, so a test that takes :func:`facts` of a shape tests what that release is,
and one that varies a shape (another version string, a runner, a model class) shows that the tools go by
the facts, not by the version.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlay.releases.facts import ReleaseFacts, release_facts

ARCH = "GlmMoeDsaForCausalLM"
SHAPES: dict[str, dict[str, Any]] = {
    "0.28.0": {"model": "deepseek_v2", "runner": "v1", "dcp": "fixed", "ops": "dcp_utils", "topk_direct": False},
    # 0.29.0 to 0.33.0 (read in 0.29.0's and 0.32.0's sources too): GLM-5 on deepseek_v32, V2 by default
    "0.29.0": {"model": "deepseek_v32", "runner": "v2", "dcp": "model", "ops": "dcp", "topk_direct": False},
    "0.33.0": {"model": "deepseek_v32", "runner": "v2", "dcp": "model", "ops": "dcp", "topk_direct": False},
    "0.34.0": {"model": "deepseek_v32", "runner": "v2-only", "dcp": "model", "ops": "dcp", "topk_direct": True},
}


@dataclass(frozen=True)
class MemoryTree:
    """A tree held as text by path (``overlay.releases.source.Tree``)."""

    files: dict[str, str]
    where: str = "<synthetic tree>"

    def read(self, path: str) -> str | None:
        return self.files.get(path)

    def write(self, root: Path) -> Path:
        """The tree as a folder at ``root``."""
        for path, text in self.files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
        return root


def _model_files(model: str) -> dict[str, str]:
    mla = {"vllm/model_executor/layers/attention/mla_attention.py":
           "class MLAAttention:\n    def forward_impl(self):\n        pass\n"}
    if model == "deepseek_v2":
        return {**mla,
                "vllm/model_executor/models/registry.py":
                    f'_VLLM_MODELS = {{\n    "{ARCH}": ("deepseek_v2", "{ARCH}"),\n}}\n',
                "vllm/model_executor/models/deepseek_v2.py":
                    "class DeepseekV2MLAAttention:\n    pass\n\n\n"
                    f"class {ARCH}(DeepseekV2ForCausalLM):\n    pass\n"}
    if model == "deepseek_v32":
        return {**mla,
                "vllm/model_executor/models/registry.py":
                    f'_VLLM_MODELS = {{\n    "{ARCH}": ("vllm.models.deepseek_v32", "{ARCH}"),\n}}\n',
                "vllm/models/deepseek_v32/__init__.py":
                    "from vllm.platforms import current_platform\n\nif current_platform.is_cuda():\n"
                    f"    from .nvidia.model import DeepseekV32ForCausalLM as {ARCH}\n"
                    "elif current_platform.is_rocm():\n"
                    f"    from .amd.model import DeepseekV32ForCausalLM as {ARCH}\n"
                    f"else:\n    from vllm.model_executor.models.deepseek_v2 import {ARCH}\n",
                "vllm/models/deepseek_v32/nvidia/model.py":
                    "from vllm.models.deepseek_v32.attention import DeepseekV32Attention\n\n\n"
                    "class DeepseekV32ForCausalLM:\n    pass\n",
                "vllm/models/deepseek_v32/attention.py":
                    "class DeepseekV32Attention(MLAAttention):\n"
                    "    def _sparse_indexer_and_attn(self):\n        pass\n"}
    return {"vllm/model_executor/models/registry.py": f'_VLLM_MODELS = {{"{ARCH}": ("{model}", "{ARCH}")}}\n',
            f"vllm/model_executor/models/{model}.py": f"class {ARCH}:\n    pass\n"}


def _runner_files(runner: str) -> dict[str, str]:
    files = {"vllm/v1/worker/gpu/model_runner.py": "class GPUModelRunner:\n    pass\n"}
    if runner == "v2-only":
        return files
    files["vllm/v1/worker/gpu_model_runner.py"] = "class GPUModelRunner:\n    pass\n"
    if runner == "v1":  # an architecture list without GLM-5 (0.28.0)
        files["vllm/config/vllm.py"] = (
            'DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES = frozenset(\n    {\n        "DeepseekV2ForCausalLM",\n'
            "    }\n)\n\n\n"
            "class VllmConfig:\n    @property\n    def use_v2_model_runner(self) -> bool:\n"
            "        if not self._is_default_v2_model_runner_model():\n            return False\n        return True\n")
    else:  # V2 for every model unless a feature it lacks is asked for (0.33.0)
        files["vllm/config/vllm.py"] = (
            "class VllmConfig:\n    @property\n    def use_v2_model_runner(self) -> bool:\n"
            "        if self._get_v2_model_runner_unsupported_features():\n            return False\n"
            "        return True\n")
    return files


def _dcp_files(dcp: str) -> dict[str, str]:
    if dcp == "fixed":
        return {"vllm/config/parallel.py": 'class ParallelConfig:\n    dcp_comm_backend: DCPCommBackend = "ag_rs"\n'}
    return {"vllm/config/parallel.py":
            "class ParallelConfig:\n    dcp_comm_backend: DCPCommBackend | None = None\n"
            "    dcp_q_replicate: bool | None = None\n\n"
            '    def set_dcp_defaults(self, comm_backend: DCPCommBackend = "ag_rs", q_replicate: bool = False):\n'
            "        pass\n",
            "vllm/model_executor/models/config.py":
            f"class {ARCH}(VerifyAndUpdateConfig):\n    @staticmethod\n    def verify_and_update_config(vllm_config):\n"
            '        vllm_config.parallel_config.set_dcp_defaults(\n            comm_backend="a2a", q_replicate=True\n'
            f"        )\n\n\nMODELS_CONFIG_MAP = {{\n    \"{ARCH}\": {ARCH},\n}}\n"}


def files(release: str = "0.33.0", *, model: str, runner: str, dcp: str, ops: str,
          topk_direct: bool, projection: str | None = None) -> dict[str, str]:
    """A synthetic tree of ``release`` in the given shape (see :data:`SHAPES`); ``projection``: the switch our
    series adds for the projection before the DCP merge ("argument": 0.34.0's ParallelConfig field, "env":
    0.28.0's variable; the bare releases have none)."""
    out = {"vllm/_version.py": f"__version__ = version = '{release}'\n",
           "vllm/envs.py": 'environment_variables = {\n    "VLLM_USE_DIRECT_DCP_A2A": lambda: maybe_convert_bool(\n'
                           '        os.getenv("VLLM_USE_DIRECT_DCP_A2A")\n    ),\n'
                           + ('    "VLLM_USE_V2_MODEL_RUNNER": lambda: maybe_convert_bool(\n'
                              '        os.getenv("VLLM_USE_V2_MODEL_RUNNER", None)\n    ),\n'
                              if runner != "v2-only" else "")
                           + "}\n",
           f"vllm/v1/attention/ops/{ops}.py": "def direct(group, dtype):\n    return envs.VLLM_USE_DIRECT_DCP_A2A\n",
           **_model_files(model), **_runner_files(runner), **_dcp_files(dcp)}
    if projection == "argument":
        out["vllm/config/parallel.py"] += '    dcp_v_up_proj_before_merge: Literal["auto", "on", "off"] = "auto"\n'
    elif projection == "env":
        out["vllm/envs.py"] = out["vllm/envs.py"].replace("environment_variables = {\n", (
            'environment_variables = {\n    "VLLM_DCP_PROJECT_BEFORE_MERGE": lambda: bool(\n'
            '        int(os.getenv("VLLM_DCP_PROJECT_BEFORE_MERGE", "1"))\n    ),\n'))
    if topk_direct:
        out["vllm/model_executor/kernels/attention/dsa/dcp_topk_direct.py"] = (
            "def get_direct_dcp_topk_workspace():\n    pass\n")
        out["vllm/model_executor/layers/sparse_attn_indexer.py"] = (
            "def _ws():\n    return get_direct_dcp_topk_workspace(envs.VLLM_USE_DIRECT_DCP_A2A)\n")
    return out


def tree(release: str = "0.33.0", like: str | None = None, **shape: Any) -> MemoryTree:
    """A synthetic tree of ``release`` shaped like release ``like`` (default: ``release``), ``shape`` changing it."""
    return MemoryTree(files(release, **{**SHAPES[like or release], **shape}))


def facts(release: str = "0.33.0", like: str | None = None, **shape: Any) -> ReleaseFacts:
    """The release facts of :func:`tree`."""
    return release_facts(tree(release, like, **shape))
