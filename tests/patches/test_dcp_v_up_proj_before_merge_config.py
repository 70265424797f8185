"""dcp-v-up-proj-before-merge-config: ``ParallelConfig.dcp_v_up_proj_before_merge`` (auto / on / off,
``--dcp-v-up-proj-before-merge``) decides whether MLA layers merge W_UV-projected outputs under DCP.

- the field and its engine argument take the three values and refuse others;
- GLM-5's attention class from the release's registry on two gloo ranks against one (``glm5_path``),
  over NCCL a2a: ``auto`` and ``on`` gather ``W_UV_dcp`` and merge through ``v_up_proj_combine``
  (the release's own policy), ``off`` gathers nothing and merges the latent output; every step
  equals DCP 1;
- the gathered W_UV's memory per layer and per GPU is logged once, naming the way to save it.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import compat
import glm5_path as g
import glm5_projection as gp
import pytest
import torch

VALUES = ["off", "auto", "on"]
RUNS = [("nccl_a2a", v) for v in VALUES]


def _engine_parser(monkeypatch: pytest.MonkeyPatch):
    """vLLM's engine argument parser (its defaults build a DeviceConfig: the CPU platform names no device)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(current_platform, "device_type", "cpu", raising=False)
    with compat.setup("EngineArgs.add_cli_args"):
        return EngineArgs.add_cli_args(FlexibleArgumentParser())


@pytest.mark.parametrize("value", VALUES)
def test_parallel_config_and_engine_argument_take_the_value(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    with compat.exercising("ParallelConfig(dcp_v_up_proj_before_merge=...)"):
        assert ParallelConfig(dcp_v_up_proj_before_merge=value).dcp_v_up_proj_before_merge == value
    assert ParallelConfig().dcp_v_up_proj_before_merge == "auto"
    parser = _engine_parser(monkeypatch)
    with compat.exercising("--dcp-v-up-proj-before-merge"):
        args = parser.parse_args(["--dcp-v-up-proj-before-merge", value])
    assert EngineArgs.from_cli_args(args).dcp_v_up_proj_before_merge == value


def test_parallel_config_refuses_other_values() -> None:
    from vllm.config import ParallelConfig

    with pytest.raises(Exception, match="dcp_v_up_proj_before_merge"):
        ParallelConfig(dcp_v_up_proj_before_merge="always")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> gp.Ranks:
    return gp.run_both(tmp_path_factory, RUNS)


@pytest.mark.parametrize("case", list(g.CASES))
@pytest.mark.parametrize("value", VALUES)
def test_nccl_a2a_step_equals_dcp1(ranks, value: str, case: str) -> None:
    gp.assert_equals_dcp1(ranks, "nccl_a2a", value, case)


@pytest.mark.parametrize("case", list(g.CASES))
@pytest.mark.parametrize("value", VALUES)
def test_the_value_decides_the_nccl_a2a_merge(ranks, value: str, case: str) -> None:
    reps = ranks.reports
    gathered = [r["W_UV_dcp"] for r in gp.build(reps, "nccl_a2a", value)]
    merged = gp.merges(gp.result(reps, "nccl_a2a", value, case))
    if value == "off":
        assert gathered == [None, None], "off must not gather W_UV over the DCP group"
        assert merged == [{("combine", g.LORA)}] * 2, merged
    else:
        assert gathered == [[g.HEADS, g.LORA, g.V]] * 2
        assert merged == [{("v_up_proj_combine", g.LORA)}] * 2, merged


def test_gathered_w_uv_memory_is_logged_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three of four layers merge projected outputs; W_UV_dcp of 2 ranks x 8 heads, 512 x 256 bf16."""
    mla = compat.module("mla_attention")
    projecting = SimpleNamespace(dcp_manager=SimpleNamespace(v_up_proj_combine=print))
    context = {f"layers.{i}": projecting for i in range(3)}
    context["layers.3"] = SimpleNamespace(dcp_manager=None)
    layer = mla.MLAAttention.__new__(mla.MLAAttention)
    torch.nn.Module.__init__(layer)
    layer.W_UV = torch.zeros(8, 512, 256, dtype=torch.bfloat16)
    layer.W_UV_dcp = torch.zeros(16, 512, 256, dtype=torch.bfloat16)
    layer._vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=context))
    lines: list[str] = []
    monkeypatch.setattr(mla.logger, "info_once", lambda msg, *args, **kw: lines.append(msg % args))
    compat.added(layer, "_log_w_uv_dcp_memory")()
    (line,) = lines
    assert "(16, 512, 256)" in line and "2.00 MiB per layer" in line and "6.00 MiB per GPU over 3" in line, line
    assert "--dcp-v-up-proj-before-merge off" in line, line


def test_engine_argument_refuses_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = _engine_parser(monkeypatch)
    parser.exit_on_error = False
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parser.parse_args(["--dcp-v-up-proj-before-merge", "always"])
