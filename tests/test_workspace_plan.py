"""``overlay.regress.workspace_plan`` against vLLM's own sizing code, and the seed's and GLM-5's figures.

The capacity formula is checked against vLLM 0.28.0's ``get_dcp_workspace_max_num_tokens`` (the
decode formula, which the series leaves as it is; called on CPU with the config attributes it
reads) and the byte formulas against the real ``DirectDCPA2AWorkspace`` /
``DirectDCPQGatherWorkspace`` constructors, whose symmetric-memory allocation (GPU-only) is
intercepted to record what they ask for. The DCP-gathered ``W_UV`` of
``dcp-project-before-merge.patch`` is checked against the figures its brief states (GLM-5 at TP8 x
DCP8: 14 MiB per layer, 1092 MiB over 78 layers).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import compat
import pytest
import torch

from overlay import cli
from overlay.regress.profiles import shipped_profiles
from overlay.regress.workspace_plan import (
    Plan,
    ServingConfig,
    a2a_workspace_bytes,
    build_config,
    capacity_tokens,
    format_plan,
    plan,
    q_gather_workspace_bytes,
    w_uv_dcp_layer_bytes,
)

SEED = dict(tp=8, dcp=4, num_heads=64, kv_lora_rank=512, max_num_seqs=128, speculative_tokens=5,
            parallel_drafting=True, max_num_batched_tokens=8192)


def _fake_vllm_config(max_num_seqs, mnbt, spec, parallel, capture):
    """The attributes the releases' sizing reads: 0.28.0 ``num_speculative_tokens`` on the config and
    ``parallel_drafting``; later ones the speculative config's tokens and its drafting slots (none for MTP,
    which drafts in the target's rows)."""
    speculative = SimpleNamespace(parallel_drafting=parallel, num_speculative_tokens=spec,
                                  max_num_new_slots_for_drafting=0) if spec else None
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=mnbt),
        speculative_config=speculative,
        num_speculative_tokens=spec,
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=capture),
    )


GRID = list(itertools.product([1, 16, 128, 256], [256, 2048, 8192], [0, 1, 5], [False, True],
                              [None, 512, 4096]))


def _sizes_parallel_drafting(real) -> bool:
    """Whether the release's sizing gives parallel drafting its own allowance (0.28.0: 1 + 2k per sequence;
    later releases refuse parallel drafting for MTP and size every drafter by its slots)."""
    import inspect

    return "parallel_drafting" in inspect.getsource(real)


def test_capacity_matches_vllm():
    """The planner's capacity is the release's own, on its tree: on production's release (the oldest carried,
    judged in its own environment by tests/test_patches_against_base.py) with its parallel-drafting allowance."""
    real = compat.symbol("dcp", "get_dcp_workspace_max_num_tokens")
    parallel_sized = _sizes_parallel_drafting(real)
    for seqs, mnbt, spec, parallel, capture in GRID:
        if parallel and not parallel_sized:
            continue  # not a configuration GLM-5 can serve on this release (MTP refuses parallel drafting)
        expected = real(_fake_vllm_config(seqs, mnbt, spec, parallel, capture))
        assert capacity_tokens(seqs, mnbt, spec, parallel, capture) == expected, (seqs, mnbt, spec, parallel)


@pytest.fixture
def allocations(monkeypatch):
    """Record the real workspaces' symmetric-memory requests instead of allocating on a GPU."""
    requested: list[int] = []

    def allocate(self, shape, dtype):
        requested.append(math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        return torch.empty(0, dtype=dtype), torch.empty(0, dtype=torch.int64)

    workspace = compat.renamed("direct_workspace")  # the direct workspaces' base class, wherever it lives
    monkeypatch.setattr(workspace, "_allocate", allocate)
    monkeypatch.setattr(workspace, "_multicast_ptrs", lambda self, s: [1] * self.num_ubatches)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    return requested


def _group(size: int):
    return SimpleNamespace(size=lambda: size, rank=lambda: 0, group_name="plan")


@pytest.mark.parametrize(("dcp", "heads", "dim", "tokens", "ubatches"),
                         [(2, 8, 512, 17, 1), (4, 8, 512, 1408, 2), (8, 16, 256, 64, 1)])
def test_a2a_bytes_match_vllm_workspace(allocations, dcp, heads, dim, tokens, ubatches):
    ws_cls = compat.symbol("dcp", "DirectDCPA2AWorkspace")
    ws_cls(_group(dcp), torch.device("cpu"), tokens, heads, dim, torch.bfloat16, ubatches)
    assert sum(allocations) == a2a_workspace_bytes(tokens, dcp, heads, dim, 2, ubatches)


@pytest.mark.parametrize(("dcp", "heads", "dim", "tokens", "ubatches", "padded"),
                         [(2, 8, 576, 17, 1, None), (4, 8, 576, 1408, 2, 64), (8, 16, 576, 64, 1, 128)])
def test_q_gather_bytes_match_vllm_workspace(allocations, dcp, heads, dim, tokens, ubatches, padded):
    ws_cls = compat.symbol("dcp", "DirectDCPQGatherWorkspace")
    ws_cls(_group(dcp), torch.device("cpu"), tokens, heads, dim, torch.bfloat16, ubatches, padded)
    assert sum(allocations) == q_gather_workspace_bytes(tokens, dcp, heads, dim, 2, ubatches, padded)


def _a2a_output_bytes(result: Plan) -> int:
    """The A2A workspace's output buffer alone (without its fp32 LSE and int32 signals)."""
    c = result.config
    slots = c.num_ubatches * 2 * c.dcp
    return result.a2a_bytes - slots * result.tokens * c.heads_per_rank * 4 - slots * 4


def test_seed_figures():
    on, off = plan(ServingConfig(**SEED)), plan(ServingConfig(**SEED, project_before_merge=False))
    assert on.tokens == off.tokens == 1408
    assert off.a2a_bytes == a2a_workspace_bytes(1408, 4, 8, 512) and abs(off.a2a_bytes / 1e6 - 92.6) < 0.1
    assert on.a2a_bytes == a2a_workspace_bytes(1408, 4, 8, 256)
    assert 2 * _a2a_output_bytes(on) == _a2a_output_bytes(off)  # v_head_dim 256: half of kv_lora_rank 512
    assert on.q_gather_bytes == off.q_gather_bytes == q_gather_workspace_bytes(1408, 4, 8, 576)


def test_glm5_w_uv_dcp_per_layer_and_per_gpu():
    assert w_uv_dcp_layer_bytes(8, 8, 512, 256) == 7 * 8 * 512 * 256 * 2 == 14 * 2**20
    result = plan(ServingConfig())  # GLM-5, TP8 x DCP8, 78 MLA layers, projection on
    assert result.w_uv_dcp_layer_bytes == 14 * 2**20
    assert result.w_uv_dcp_bytes == 1092 * 2**20
    assert result.total_bytes == result.q_gather_bytes + result.a2a_bytes + 1092 * 2**20
    assert ("W_UV_dcp: 14.0 MiB per layer x 78 layers = 1.07 GiB per GPU (1092.0 MiB), counted in the model's "
            "weight memory" in format_plan(result))
    assert plan(ServingConfig(dcp=4)).w_uv_dcp_layer_bytes == 3 * 8 * 512 * 256 * 2  # 6 MiB
    assert plan(ServingConfig(num_layers=3)).w_uv_dcp_bytes == 42 * 2**20


def test_projection_sizes_the_a2a_output_and_gathers_w_uv():
    on, off = plan(ServingConfig()), plan(ServingConfig(project_before_merge=False))
    assert (on.config.a2a_head_dim, off.config.a2a_head_dim) == (256, 512)
    assert on.a2a_bytes == a2a_workspace_bytes(on.tokens, 8, 8, 256)
    assert off.a2a_bytes == a2a_workspace_bytes(off.tokens, 8, 8, 512)
    assert 2 * _a2a_output_bytes(on) == _a2a_output_bytes(off)
    assert off.w_uv_dcp_layer_bytes == off.w_uv_dcp_bytes == 0
    assert off.total_bytes == off.q_gather_bytes + off.a2a_bytes
    assert "W_UV_dcp: none (projection off, VLLM_DCP_PROJECT_BEFORE_MERGE=0" in format_plan(off)
    assert plan(ServingConfig(v_head_dim=128)).a2a_bytes == a2a_workspace_bytes(on.tokens, 8, 8, 128)


def test_dcp_1_allocates_nothing():
    for project in (True, False):
        result = plan(ServingConfig(dcp=1, project_before_merge=project))
        assert not result.config.projects_before_merge
        assert (result.q_gather_bytes, result.a2a_bytes, result.w_uv_dcp_bytes, result.total_bytes) == (0, 0, 0, 0)
        assert result.tokens == 256  # the capacity vLLM would size, unused
        assert "W_UV_dcp: none (DCP 1" in format_plan(result)


def test_json_carries_every_figure():
    d = plan(ServingConfig()).to_dict()
    assert d["config"]["v_head_dim"] == 256 and d["config"]["num_layers"] == 78
    assert d["project_before_merge"] is True and d["a2a_head_dim"] == 256
    assert d["w_uv_dcp"] == {"layer_bytes": 14 * 2**20, "num_layers": 78, "bytes": 1092 * 2**20}
    assert d["total_bytes"] == d["q_gather_bytes"] + d["a2a_bytes"] + d["w_uv_dcp"]["bytes"]
    assert "rows" not in d and "delta" not in d


def test_invalid_layout():
    with pytest.raises(ValueError):
        ServingConfig(tp=3)


def test_cli_flags(capsys):
    assert cli.main(["workspace-plan", *(f"--{k.replace('_', '-')}={v}" for k, v in SEED.items()
                                        if k != "parallel_drafting"), "--parallel-drafting"]) == 0
    out = capsys.readouterr().out
    assert "capacity: 1408 tokens per step (decode formula); steps above it take the NCCL fallback" in out
    assert "max_num_batched_tokens      " not in out and "WORKSPACE_SIZING" not in out
    assert "A2A: 4 ranks x 2 buffers x 8 heads x 256 x 2 B" in out
    assert "W_UV_dcp: 6.0 MiB per layer x 78 layers = 0.46 GiB per GPU" in out
    assert cli.main(["workspace-plan", "--no-project-before-merge", "--v-head-dim", "128", "--num-layers", "3",
                     "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["a2a_head_dim"], d["w_uv_dcp"]["bytes"], d["config"]["v_head_dim"]) == (512, 0, 128)
    assert cli.main(["workspace-plan", "--v-head-dim", "128", "--num-layers", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["w_uv_dcp"]["bytes"] == 3 * 7 * 8 * 512 * 128 * 2


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-layers", "0"], "error: --num-layers (num_layers) must be a positive integer, got 0\n"),
    (["--v-head-dim", "-256"], "error: --v-head-dim (v_head_dim) must be a positive integer, got -256\n"),
])
def test_cli_bad_field_is_one_line_naming_the_flag(capsys, argv, message):
    assert cli.main(["workspace-plan", *argv]) == 1
    assert capsys.readouterr().err == message


def test_profile_is_read_and_flags_override():
    from overlay.regress.profiles import load_profile

    name = "glm5.2-nvfp4-tp8-dcp4-mtp5-a2a"
    assert load_profile(name).server.arg_value("--decode-context-parallel-size") == "4"
    config = build_config(name)
    assert (config.tp, config.dcp, config.speculative_tokens, config.max_num_batched_tokens) == (8, 4, 5, 8192)
    assert build_config(name, dcp=2).dcp == 2
    assert config.project_before_merge  # the profile's env leaves it unset: the patch's default, on
    seeded = build_config(name, parallel_drafting=True)
    assert plan(seeded).tokens == capacity_tokens(128, 8192, 5, True) == 1408
    assert not build_config(name, project_before_merge=False).projects_before_merge


def _profile_with_env(tmp_path, value: str) -> str:
    from overlay.regress.profiles import load_profile

    name = "tiny-glm5-tp2-dcp2-mtp5"
    assert load_profile(name).server.env["VLLM_DCP_PROJECT_BEFORE_MERGE"] == "1"
    text = (Path(__file__).parents[1] / "overlay/regress/profiles" / f"{name}.yaml").read_text(encoding="utf-8")
    path = tmp_path / f"{name}-{value or 'empty'}.yaml"
    path.write_text(text.replace('VLLM_DCP_PROJECT_BEFORE_MERGE: "1"', f'VLLM_DCP_PROJECT_BEFORE_MERGE: "{value}"'),
                    encoding="utf-8")
    return str(path)


def test_profile_env_turns_the_projection_off(tmp_path):
    assert build_config("tiny-glm5-tp2-dcp2-mtp5").projects_before_merge
    off = build_config(_profile_with_env(tmp_path, "0"))
    assert off.project_before_merge is False and off.dcp == 2
    result = plan(off)
    assert result.w_uv_dcp_bytes == 0 and result.config.a2a_head_dim == 512
    assert build_config(_profile_with_env(tmp_path, "0"), project_before_merge=True).projects_before_merge


@pytest.mark.parametrize("value", ["yes", ""])
def test_profile_env_that_vllm_cannot_read_is_one_line(tmp_path, capsys, value):
    path = _profile_with_env(tmp_path, value)
    with pytest.raises(ValueError, match=r"server\.env\.VLLM_DCP_PROJECT_BEFORE_MERGE must be an integer"):
        build_config(path)
    assert cli.main(["workspace-plan", "--profile", path]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "VLLM_DCP_PROJECT_BEFORE_MERGE" in err and repr(value) in err


@pytest.mark.parametrize("profile", shipped_profiles())
def test_shipped_profiles_state_the_capacity_their_server_has(profile: str) -> None:
    """The long-context check must overflow the real capacity: the profile's number is computed."""
    from overlay.regress.profiles import load_profile

    stated = load_profile(profile).long_context.workspace_capacity_tokens
    computed = plan(build_config(profile)).tokens
    assert stated == computed, (f"overlay/regress/profiles/{profile}.yaml: long_context.workspace_capacity_tokens "
                                f"{stated}, but make workspace-plan PROFILE={profile} gives {computed}")


def test_default_cudagraph_capture_size_follows_vllm() -> None:
    assert ServingConfig(max_num_seqs=128).effective_cudagraph_capture_size == 256
    assert ServingConfig(max_num_seqs=128, speculative_tokens=5).effective_cudagraph_capture_size == 512
    assert ServingConfig(max_num_seqs=4, max_num_batched_tokens=4).effective_cudagraph_capture_size == 4
    assert ServingConfig(cudagraph_capture_size=64).effective_cudagraph_capture_size == 64
    assert plan(ServingConfig(max_num_seqs=128)).tokens == 256
