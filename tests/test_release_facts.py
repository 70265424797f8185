"""The release facts (issue 41 item 3): read from the real trees of 0.28.0, 0.33.0 and 0.34.0 as their
source says, each equal to the synthetic shape the other tests take (``tests/factskit.py``), and a release
they cannot describe refused in one line naming each missing fact."""

from __future__ import annotations

from pathlib import Path

import pytest

from overlay.build.pins import carried_releases
from overlay.releases import derive
from overlay.releases.facts import ReleaseFacts, ReleaseFactsError, glm5_path, release_facts
from overlay.releases.source import FolderTree, WheelTree, open_tree
from overlay.releases.table import ATTENTION
from tests import factskit

REPO = Path(__file__).resolve().parent.parent
V32 = "vllm.models.deepseek_v32"


def _pinned_tree(version: str) -> Path:
    from overlay.maintain.trees import base_tree

    return base_tree(REPO / "patches", version)


def _sdist_tree(version: str) -> factskit.MemoryTree:
    """The release's Python files from its sdist (fetched through pip from PyPI, verified against
    ``patches/<version>/pin.toml`` or ``tests/pins/<version>/pin.toml``, cached): the wheel is not needed."""
    from overlay.build.pins import load_pin
    from overlay.build.sdist import fetch_sdist, read_sources

    pins = REPO / "patches" if (REPO / "patches" / version / "pin.toml").is_file() else REPO / "tests" / "pins"
    sdist = fetch_sdist(load_pin(pins, version), f"{pins / version / 'pin.toml'}")
    return factskit.MemoryTree(read_sources(sdist, lambda rel: rel.startswith("vllm/") and rel.endswith(".py")),
                               str(sdist))


@pytest.mark.slow
@pytest.mark.parametrize("version", carried_releases(REPO / "patches"))
def test_the_pinned_releases_facts_are_their_shapes(version: str) -> None:
    assert release_facts(_pinned_tree(version)) == factskit.facts(version)


@pytest.mark.slow
def test_0_29_0_first_ran_glm5_on_deepseek_v32_with_v2_and_its_own_dcp_defaults() -> None:
    """0.29.0, read in its source: already 0.33.0's shape, so the cases the engine check wrote for 0.33.0 (its
    own DCP defaults, the V1 runner beside V2) are 0.29.0's too; the version sets they were keyed by skipped them."""
    assert release_facts(_sdist_tree("0.29.0")) == factskit.facts("0.29.0") == factskit.facts("0.29.0", like="0.33.0")


@pytest.mark.slow
def test_0_34_0s_facts_from_its_sdist() -> None:
    """0.34.0, read in its source: Model Runner V1 removed (no ``gpu_model_runner.py``; ``platforms/interface.py``
    refuses ``VLLM_USE_V2_MODEL_RUNNER=0``), GLM-5 still on ``deepseek_v32``'s CUDA model, its config choosing a2a
    with query replication, the DCP ops in ``ops/dcp.py``, and ``VLLM_USE_DIRECT_DCP_A2A`` (default: auto)
    switching the combine and the new direct top-k exchange alike."""
    tree = _sdist_tree("0.34.0")
    facts = release_facts(tree)
    assert facts == factskit.facts("0.34.0")
    assert (facts.runner, facts.v1_runner) == ("v2", False)
    assert "Model Runner V1 has been removed" in (tree.read("vllm/platforms/interface.py") or "")
    assert facts.glm5.model_class == f"{V32}.nvidia.model.DeepseekV32ForCausalLM"
    assert (facts.dcp_comm_backend, facts.dcp_q_replicate, facts.dcp_defaults_by_model) == ("a2a", True, True)
    assert facts.direct_a2a_switches == ("vllm.v1.attention.ops.dcp",
                                         "vllm.model_executor.kernels.attention.dsa.dcp_topk_direct")
    assert facts.direct_a2a_default is None


def test_what_the_facts_read_in_each_shape() -> None:
    old, mid, new = (factskit.facts(v) for v in ("0.28.0", "0.33.0", "0.34.0"))
    assert (old.glm5.entry, mid.glm5.entry) == ("forward_impl", "sparse_indexer_and_attn")
    assert old.glm5.attention_class == "DeepseekV2MLAAttention" and mid.glm5.attention_class == "DeepseekV32Attention"
    assert [(f.runner, f.v1_runner, f.runs_v1_by_choice) for f in (old, mid, new)] == [
        ("v1", True, False), ("v2", True, True), ("v2", False, False)]
    assert (old.dcp_comm_backend, old.dcp_q_replicate, old.dcp_defaults_by_model) == ("ag_rs", None, False)
    assert (old.dcp_ops, mid.dcp_ops) == ("vllm.v1.attention.ops.dcp_utils", "vllm.v1.attention.ops.dcp")
    assert ReleaseFacts.from_dict(new.to_dict()) == new


def test_a_v1_release_whose_architecture_list_names_glm5_defaults_to_v2() -> None:
    tree = factskit.tree("0.28.0")
    tree.files["vllm/config/vllm.py"] = tree.files["vllm/config/vllm.py"].replace(
        '"DeepseekV2ForCausalLM",', '"DeepseekV2ForCausalLM",\n        "GlmMoeDsaForCausalLM",')
    assert derive.runner(tree) == ("v2", True)


def test_the_cuda_branch_is_the_one_followed() -> None:
    """The registry's module binds GLM-5 per platform: the class bound under ``is_cuda()`` (negations and
    ``elif`` chains taken as on CUDA), however many imports away."""
    tree = factskit.tree("0.33.0")
    init = f"{V32.replace('.', '/')}/__init__.py"
    tree.files[init] = ("if not current_platform.is_cuda():\n    from .amd.model import X as GlmMoeDsaForCausalLM\n"
                        "else:\n    from .nvidia import GlmMoeDsaForCausalLM\n")
    tree.files[f"{V32.replace('.', '/')}/nvidia/__init__.py"] = \
        "from .model import DeepseekV32ForCausalLM as GlmMoeDsaForCausalLM\n"
    assert derive.model_class(tree) == f"{V32}.nvidia.model.DeepseekV32ForCausalLM"


def test_every_table_entry_says_its_evidence() -> None:
    for model_class, entry in ATTENTION.items():
        assert len(entry.evidence) > 60 and entry.entry in ("forward_impl", "sparse_indexer_and_attn"), model_class


def test_a_release_the_facts_cannot_describe_is_one_line_naming_what_is_missing() -> None:
    tree = factskit.tree("0.35.0", like="0.34.0")
    tree.files["vllm/model_executor/models/registry.py"] = \
        '_VLLM_MODELS = {"GlmMoeDsaForCausalLM": ("glm5", "GlmMoeDsaForCausalLM")}\n'
    tree.files["vllm/model_executor/models/glm5.py"] = "class GlmMoeDsaForCausalLM:\n    pass\n"
    del tree.files["vllm/config/parallel.py"]
    with pytest.raises(ReleaseFactsError) as err:
        release_facts(tree)
    assert str(err.value) == (
        "<synthetic tree>: vllm 0.35.0: the release facts cannot describe it: GLM-5's path: GLM-5 resolves to "
        "vllm.model_executor.models.glm5.GlmMoeDsaForCausalLM, which overlay/releases/table.py:ATTENTION does not "
        "describe (add its attention class and DCP entry there, with the evidence); GLM-5's DCP defaults: "
        "vllm/config/parallel.py: not in the tree")
    with pytest.raises(ReleaseFactsError, match="GLM-5's path: GLM-5 resolves to"):
        glm5_path(tree)


def test_a_table_entry_the_tree_contradicts_is_refused() -> None:
    """An entry is checked in the tree it describes: an attention without its DCP entry is missing there."""
    tree = factskit.tree("0.33.0")
    tree.files[f"{V32.replace('.', '/')}/attention.py"] = "class DeepseekV32Attention(MLAAttention):\n    pass\n"
    with pytest.raises(ReleaseFactsError) as err:
        release_facts(tree)
    assert str(err.value).endswith(
        f"GLM-5's path: overlay/releases/table.py:ATTENTION[{V32}.nvidia.model.DeepseekV32ForCausalLM]: "
        "vllm/models/deepseek_v32/attention.py: DeepseekV32Attention defines no _sparse_indexer_and_attn")
    assert "\n" not in str(err.value)


def test_a_folder_and_a_wheel_read_alike(tmp_path: Path) -> None:
    from tests.wheelkit import make_wheel

    files = factskit.tree("0.33.0").files
    factskit.tree("0.33.0").write(tmp_path / "tree")
    wheel = make_wheel(tmp_path, {p: t.encode() for p, t in files.items()}, version="0.33.0")
    assert isinstance(open_tree(wheel), WheelTree) and isinstance(open_tree(tmp_path / "tree"), FolderTree)
    assert release_facts(wheel) == release_facts(tmp_path / "tree") == factskit.facts("0.33.0")


def test_the_patch_tests_find_the_dcp_ops_where_the_facts_read_them() -> None:
    """``tests/compat.py`` (where the patch tests import vLLM's moved modules from) agrees with the facts on
    the DCP ops' module in every release shape read so far."""
    from packaging.version import Version

    from tests import compat

    for version in factskit.SHAPES:
        assert compat.module_path("dcp", Version(version)) == factskit.facts(version).dcp_ops, version
