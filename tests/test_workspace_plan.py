"""``overlay.regress.workspace_plan`` against vLLM's own sizing code, and the seed's figures.

The capacity formula is checked against vLLM's ``get_dcp_workspace_max_num_tokens`` (called on
CPU with the config attributes it reads) and the byte formulas against the real
``DirectDCPA2AWorkspace`` / ``DirectDCPQGatherWorkspace`` constructors, whose symmetric-memory
allocation (GPU-only) is intercepted to record what they ask for.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import compat
import pytest
import torch

from overlay import cli
from overlay.regress.workspace_plan import (
    ServingConfig,
    a2a_workspace_bytes,
    build_config,
    capacity_tokens,
    plan,
    q_gather_workspace_bytes,
)

SEED = dict(tp=8, dcp=4, num_heads=64, kv_lora_rank=512, max_num_seqs=128, speculative_tokens=5,
            parallel_drafting=True, max_num_batched_tokens=8192)


def _fake_vllm_config(max_num_seqs, mnbt, spec, parallel, capture):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=mnbt),
        speculative_config=SimpleNamespace(parallel_drafting=parallel) if spec else None,
        num_speculative_tokens=spec,
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=capture),
    )


GRID = list(itertools.product([1, 16, 128, 256], [256, 2048, 8192], [0, 1, 5], [False, True],
                              [None, 512, 4096]))


def test_decode_capacity_matches_vllm(monkeypatch):
    monkeypatch.setenv("VLLM_DCP_DIRECT_WORKSPACE_SIZING", "decode")
    real = compat.symbol("dcp", "get_dcp_workspace_max_num_tokens")
    for seqs, mnbt, spec, parallel, capture in GRID:
        expected = real(_fake_vllm_config(seqs, mnbt, spec, parallel, capture))
        assert capacity_tokens(seqs, mnbt, spec, parallel, capture) == expected, (seqs, mnbt, spec, parallel)


def test_batched_capacity_matches_patched_vllm(monkeypatch):
    envs = pytest.importorskip("vllm.envs")
    if "VLLM_DCP_DIRECT_WORKSPACE_SIZING" not in envs.environment_variables:
        pytest.skip("the vLLM under test has no dcp-direct-a2a-fallback.patch")
    monkeypatch.setenv("VLLM_DCP_DIRECT_WORKSPACE_SIZING", "max_num_batched_tokens")
    real = compat.symbol("dcp", "get_dcp_workspace_max_num_tokens")
    for seqs, mnbt, spec, parallel, capture in GRID[::5]:
        assert real(_fake_vllm_config(seqs, mnbt, spec, parallel, capture)) == capacity_tokens(
            seqs, mnbt, spec, parallel, capture, sizing="max_num_batched_tokens")


@pytest.fixture
def allocations(monkeypatch):
    """Record the real workspaces' symmetric-memory requests instead of allocating on a GPU."""
    dcp = compat.module("dcp")
    requested: list[int] = []

    def allocate(self, shape, dtype):
        requested.append(math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        return torch.empty(0, dtype=dtype), torch.empty(0, dtype=torch.int64)

    monkeypatch.setattr(dcp._DirectDCPWorkspace, "_allocate", allocate)
    monkeypatch.setattr(dcp._DirectDCPWorkspace, "_multicast_ptrs", lambda self, s: [1] * self.num_ubatches)
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


def test_seed_figures():
    result = plan(ServingConfig(**SEED)).to_dict()
    decode, full = result["rows"]
    assert (decode["tokens"], full["tokens"]) == (1408, 8192)
    assert abs(result["delta"]["a2a_bytes"] / 1e6 - 446) < 1  # "adds ~446 MB/GPU"
    assert 70e6 <= result["delta"]["q_gather_bytes"] <= 280e6  # "~70-280 MB for q_gather"


def test_invalid_sizing_and_layout():
    with pytest.raises(ValueError):
        capacity_tokens(1, 1, sizing="everything")
    with pytest.raises(ValueError):
        ServingConfig(tp=3)


def test_cli_flags(capsys):
    assert cli.main(["workspace-plan", *(f"--{k.replace('_', '-')}={v}" for k, v in SEED.items()
                                        if k != "parallel_drafting"), "--parallel-drafting"]) == 0
    out = capsys.readouterr().out
    assert "decode                      1408" in out and "max_num_batched_tokens      8192" in out
    assert "446.3 MB" in out


def test_profile_is_read_and_flags_override():
    from overlay.regress.profiles import load_profile

    name = "glm5.2-nvfp4-tp8-dcp4-mtp5-a2a"
    assert load_profile(name).server.arg_value("--decode-context-parallel-size") == "4"
    config = build_config(name)
    assert (config.tp, config.dcp, config.speculative_tokens, config.max_num_batched_tokens) == (8, 4, 5, 8192)
    assert build_config(name, dcp=2).dcp == 2
    seeded = build_config(name, parallel_drafting=True)
    assert plan(seeded).row("decode").tokens == capacity_tokens(128, 8192, 5, True) == 1408


@pytest.mark.parametrize("profile", ["glm5.2-fp8-tp8-dcp8", "glm5.2-nvfp4-tp8-dcp4-mtp5-a2a"])
def test_shipped_profiles_state_the_capacity_their_server_has(profile: str) -> None:
    """The long-context check must overflow the real capacity: the profile's number is computed."""
    from overlay.regress.profiles import load_profile

    stated = load_profile(profile).long_context.workspace_capacity_tokens
    assert stated == plan(build_config(profile)).row("decode").tokens


def test_default_cudagraph_capture_size_follows_vllm() -> None:
    assert ServingConfig(max_num_seqs=128).effective_cudagraph_capture_size == 256
    assert ServingConfig(max_num_seqs=128, speculative_tokens=5).effective_cudagraph_capture_size == 512
    assert ServingConfig(max_num_seqs=4, max_num_batched_tokens=4).effective_cudagraph_capture_size == 4
    assert ServingConfig(cudagraph_capture_size=64).effective_cudagraph_capture_size == 64
    assert plan(ServingConfig(max_num_seqs=128)).row("decode").tokens == 256
