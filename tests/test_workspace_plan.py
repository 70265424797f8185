"""``overlay.regress.workspace_plan`` against vLLM's own sizing code, and the seed's and GLM-5's figures.

The capacity formula is checked against vLLM 0.28.0's ``get_dcp_workspace_max_num_tokens`` (the
decode formula, which the series leaves as it is; called on CPU with the config attributes it
reads) and the byte formulas against the real ``DirectDCPA2AWorkspace`` /
``DirectDCPQGatherWorkspace`` constructors, whose symmetric-memory allocation (GPU-only) is
intercepted to record what they ask for. The DCP-gathered ``W_UV`` of
``dcp-project-before-merge.patch`` is checked against the figures its brief states (GLM-5 at TP8 x
DCP8: 14 MiB per layer, 1092 MiB over 78 layers).

A profile's projection is read in either build's spelling: 0.34.0's series' ``--dcp-v-up-proj-before-merge
auto|on|off`` (``auto`` resolved for the profile's transport as that series resolves it), 0.28.0's
``VLLM_DCP_PROJECT_BEFORE_MERGE``; the profiles are written here, so these tests hold on every release's
environment (``tests/test_patches_against_base.py`` runs this file on 0.28.0's); the one tie to a tree, the
defaults ``auto`` is resolved with, is checked where the installed build has the argument.
"""

from __future__ import annotations

import itertools
import json
import math
import re
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
    assert "W_UV_dcp: none (projection off: the merge exchanges kv_lora_rank 512, no W_UV gathered)" in format_plan(off)
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


PROJECTION = "--dcp-v-up-proj-before-merge"
TINY = "tiny-glm5-tp2-dcp2-mtp5"  # TP2 x DCP2 over the direct a2a, the projection on by the argument


def _profile_with(tmp_path: Path, args: dict[str, str | None] | None = None, env: dict[str, str | None] | None = None,
                  *, equals: bool = False, name: str = TINY) -> str:
    """A copy of a shipped profile whose ``server.args`` flags and ``server.env`` variables are set as given
    (None: removed); ``equals`` writes each flag as ``--flag=value``."""
    import yaml

    from overlay.regress.profiles import load_profile

    doc = yaml.safe_load((Path(__file__).parents[1] / load_profile(name).path).read_text(encoding="utf-8"))
    server = doc["server"]
    for flag, value in (args or {}).items():
        argv = [str(a) for a in server["args"]]
        if flag in argv:
            del argv[argv.index(flag):argv.index(flag) + 2]
        if value is not None:
            argv += [f"{flag}={value}"] if equals else [flag, value]
        server["args"] = argv
    for var, value in (env or {}).items():
        server["env"].pop(var, None)
        if value is not None:
            server["env"][var] = value
    path = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return str(path)


def test_the_tiny_profiles_project_by_the_argument(capsys) -> None:
    """The two-GPU profiles say on in 0.34.0's spelling; the plan names it."""
    from overlay.regress.profiles import load_profile

    for name in (TINY, "tiny-glm5-tp2-dcp2-agrs-mtp5"):
        server = load_profile(name).server
        assert server.arg_value(PROJECTION) == "on" and "VLLM_DCP_PROJECT_BEFORE_MERGE" not in server.env, name
        config = build_config(name)
        assert config.projects_before_merge and config.projection_source == f"server.args {PROJECTION} on", name
    assert cli.main(["workspace-plan", "--profile", TINY, "--num-heads", "16", "--num-layers", "3"]) == 0
    out = capsys.readouterr().out
    assert f"projection before the DCP merge: on (server.args {PROJECTION} on): the A2A output holds v_head_dim" in out
    assert "W_UV_dcp: 2.0 MiB per layer x 3 layers" in out


@pytest.mark.parametrize(("backend", "direct", "on", "why"), [
    ("a2a", "1", False, "--dcp-comm-backend a2a over the direct A2A (VLLM_USE_DIRECT_DCP_A2A=1)"),
    ("a2a", None, False, "--dcp-comm-backend a2a over the direct A2A (VLLM_USE_DIRECT_DCP_A2A unset: direct on one "
                         "node)"),
    ("a2a", "0", True, "--dcp-comm-backend a2a over NCCL (VLLM_USE_DIRECT_DCP_A2A=0): auto projects there"),
    ("ag_rs", "0", False, "--dcp-comm-backend ag_rs: auto projects over the NCCL a2a only"),
    ("ag_rs", None, False, "--dcp-comm-backend ag_rs: auto projects over the NCCL a2a only"),
    (None, "0", True, "a2a, GLM-5's default on 0.34.0 over NCCL (VLLM_USE_DIRECT_DCP_A2A=0)"),
    (None, None, False, "a2a, GLM-5's default on 0.34.0 over the direct A2A"),
], ids=["a2a-direct", "a2a-direct-unset", "a2a-nccl", "ag_rs-direct0", "ag_rs", "default-nccl", "default-direct"])
def test_auto_is_resolved_for_the_transport(tmp_path, backend, direct, on, why) -> None:
    """auto (0.34.0's series, upstream's policy): projected over the NCCL All-to-All only, so the A2A output and
    W_UV_dcp follow the profile's comm backend and direct switch."""
    for equals in (False, True):
        path = _profile_with(tmp_path, {PROJECTION: "auto", "--dcp-comm-backend": backend},
                             {"VLLM_USE_DIRECT_DCP_A2A": direct}, equals=equals)
        config = build_config(path)
        assert config.project_before_merge is on
        assert config.projection_source.startswith(f"server.args {PROJECTION} auto, {why}")
        result = plan(config)
        assert (result.config.a2a_head_dim, result.w_uv_dcp_bytes > 0) == ((256, True) if on else (512, False))
        assert f"projection before the DCP merge: {'on' if on else 'off'} (server.args {PROJECTION} auto, " in (
            format_plan(result))


@pytest.mark.parametrize("backend", ["a2a", "ag_rs", None])
def test_on_and_off_mean_every_transport(tmp_path, backend) -> None:
    for value, on in (("on", True), ("off", False)):
        config = build_config(_profile_with(tmp_path, {PROJECTION: value, "--dcp-comm-backend": backend}))
        assert (config.project_before_merge, config.projection_source) == (on, f"server.args {PROJECTION} {value}")


def test_0_28_0s_variable_is_still_read(tmp_path) -> None:
    for raw, on in (("0", False), ("1", True)):
        path = _profile_with(tmp_path, {PROJECTION: None}, {"VLLM_DCP_PROJECT_BEFORE_MERGE": raw})
        config = build_config(path)
        assert config.project_before_merge is on and config.dcp == 2
        assert config.projection_source == f"server.env VLLM_DCP_PROJECT_BEFORE_MERGE={raw}"
        assert f"projection before the DCP merge: {'on' if on else 'off'} (server.env VLLM_DCP_PROJECT_BEFORE_MERGE=" \
               f"{raw})" in format_plan(plan(config))
    off = build_config(_profile_with(tmp_path, {PROJECTION: None}, {"VLLM_DCP_PROJECT_BEFORE_MERGE": "0"}))
    result = plan(off)
    assert result.w_uv_dcp_bytes == 0 and result.config.a2a_head_dim == 512
    overridden = build_config(_profile_with(tmp_path, {PROJECTION: None}, {"VLLM_DCP_PROJECT_BEFORE_MERGE": "0"}),
                              project_before_merge=True)
    assert overridden.projects_before_merge and overridden.projection_source == "--project-before-merge"


def test_a_profile_without_either_says_what_the_plan_assumed() -> None:
    config = build_config("glm5.2-fp8-tp8-dcp8")
    assert config.project_before_merge
    assert config.projection_source.startswith("the profile sets neither --dcp-v-up-proj-before-merge nor "
                                               "VLLM_DCP_PROJECT_BEFORE_MERGE: on")
    assert build_config().projection_source.startswith("the default")
    assert build_config(project_before_merge=False).projection_source == "--no-project-before-merge"


def _refused(capsys, path: str, pattern: str) -> None:
    """build_config refuses the profile, and the CLI says so in one line naming the field."""
    with pytest.raises(ValueError, match=pattern):
        build_config(path)
    assert cli.main(["workspace-plan", "--profile", path]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: "), err
    assert re.search(pattern, err), err


def test_both_spellings_in_one_profile_are_refused(tmp_path, capsys) -> None:
    path = _profile_with(tmp_path, env={"VLLM_DCP_PROJECT_BEFORE_MERGE": "1"})
    _refused(capsys, path, r"server\.args --dcp-v-up-proj-before-merge 'on' and "
                           r"server\.env\.VLLM_DCP_PROJECT_BEFORE_MERGE both set the projection")


@pytest.mark.parametrize(("args", "env", "pattern"), [
    ({PROJECTION: "yes"}, {}, r"server\.args: --dcp-v-up-proj-before-merge 'yes': expected on, off, auto"),
    ({PROJECTION: "auto", "--dcp-comm-backend": "nccl"}, {},
     r"server\.args: --dcp-comm-backend 'nccl': expected ag_rs or a2a"),
    ({PROJECTION: "auto"}, {"VLLM_USE_DIRECT_DCP_A2A": "on"},
     r"server\.env\.VLLM_USE_DIRECT_DCP_A2A must be an integer .*got 'on'"),
    ({PROJECTION: None}, {"VLLM_DCP_PROJECT_BEFORE_MERGE": "yes"},
     r"server\.env\.VLLM_DCP_PROJECT_BEFORE_MERGE must be an integer .*got 'yes'"),
    ({PROJECTION: None}, {"VLLM_DCP_PROJECT_BEFORE_MERGE": ""},
     r"server\.env\.VLLM_DCP_PROJECT_BEFORE_MERGE must be an integer .*got ''"),
])
def test_a_value_a_build_would_refuse_is_one_line(tmp_path, capsys, args, env, pattern) -> None:
    _refused(capsys, _profile_with(tmp_path, args, env), pattern)


def test_the_argument_without_its_value_is_one_line(tmp_path, capsys) -> None:
    import yaml

    path = Path(_profile_with(tmp_path, {PROJECTION: None}))
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    doc["server"]["args"].append(PROJECTION)
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    _refused(capsys, str(path), r"server\.args: --dcp-v-up-proj-before-merge is the last argument, without its value")


def test_auto_is_resolved_with_the_installed_builds_defaults() -> None:
    """What auto_projects takes for a profile that names no backend or direct switch is what a build with the
    argument (our 0.34.0 series) gives GLM-5: a2a, and the direct A2A where symmetric memory serves."""
    import vllm

    from overlay.regress.workspace_plan import AUTO_DEFAULT_BACKEND
    from overlay.releases.facts import release_facts

    facts = release_facts(Path(vllm.__file__).parent.parent)
    if facts.projection_switch != "argument":
        pytest.skip(f"vLLM {facts.release} has no {PROJECTION} (its switch: {facts.projection_switch}): no auto")
    assert facts.dcp_comm_backend == AUTO_DEFAULT_BACKEND
    assert facts.direct_a2a_default is None  # unset: direct where symmetric memory serves (one node)


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
