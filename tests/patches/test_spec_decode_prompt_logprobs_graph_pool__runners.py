"""spec-decode-prompt-logprobs-graph-pool on the model runner a GLM-5 MTP engine gets.

The patch is in the V1 runner (``vllm/v1/worker/gpu_model_runner.py``). Which runner serves an
engine is ``VllmConfig.use_v2_model_runner``: ``VLLM_USE_V2_MODEL_RUNNER`` when set, else the
release's choice. vLLM 0.28.0 picks Model Runner V2 only for a list of architectures that lacks
``GlmMoeDsaForCausalLM``; 0.33.0 picks it on CUDA for every model unless a feature it lacks is asked
for (upstream #53183), and MTP is not one. Model Runner V2 computes prompt logprobs in
``sample_tokens`` before its speculator proposes: the drafter's graph replays cannot have
overwritten the target's hidden states yet, so #53488 does not arise there.

For each setting (the release's default, ``VLLM_USE_V2_MODEL_RUNNER=0``, ``=1``), with Triton
present as on CUDA (this CPU has none, which alone would send vLLM to V1): the runner the real
``VllmConfig`` picks for a GLM-5 model with vLLM's MTP ``SpeculativeConfig`` is driven through its
real ``sample_tokens`` with a drafter that writes into the storage of the hidden states (a graph
replay reusing the pool), and the prompt logprobs must see the target's hidden states. The V1 cases
fail on the unpatched base; the V2 ones hold there: the patch is not needed on Model Runner V2.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import compat
import pytest
import sparse_dcp_harness as h
import test_spec_decode_prompt_logprobs_graph_pool as v1
import torch

TOKENS, HIDDEN = v1.TOKENS, v1.HIDDEN


class _PromptLogprobsReached(Exception):
    """Raised by the prompt-logprobs stand-in once it has recorded its input."""


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(a real VllmConfig of the small GLM-5 model with MTP-5, its SpeculativeConfig)."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    root = tmp_path_factory.mktemp("glm5-mtp-runner")
    with compat.setup("the GLM-5 VllmConfig with vLLM's MTP SpeculativeConfig"):
        vc = h.make_vllm_config(root / "model", dcp=1)
        (root / "mtp").mkdir()
        (root / "mtp" / "config.json").write_text(json.dumps({**h.glm5_config(), "num_nextn_predict_layers": 1}))
        model = ModelConfig(model=str(root / "mtp"), tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                            max_model_len=4096)
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=5, target_model_config=model,
                                 target_parallel_config=ParallelConfig())
        vc.speculative_config = spec
    return vc, spec


def _runner(vc, env: str | None, monkeypatch: pytest.MonkeyPatch) -> str:
    """"v1" or "v2": the model runner ``vc`` resolves to under ``VLLM_USE_V2_MODEL_RUNNER=env``. A release
    without Model Runner V1 (0.34.0: no ``VllmConfig.use_v2_model_runner``) runs V2, and refuses ``=0``."""
    if not hasattr(type(vc), "use_v2_model_runner"):
        if env == "0":
            v1.v1_runner_cls()  # skips: V1 removed, VLLM_USE_V2_MODEL_RUNNER=0 refused at start-up
        return "v2"
    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    monkeypatch.setattr(compat.module("vllm_config"), "HAS_TRITON", True)  # CUDA has Triton
    return "v2" if vc.use_v2_model_runner else "v1"


def _run_v2_until_prompt_logprobs(spec_config: Any) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Drive Model Runner V2's ``sample_tokens`` of a bare runner; return (target hidden states as
    produced, what the prompt logprobs got, the order of the steps)."""
    runner_cls = compat.symbol("gpu_model_runner_v2", "GPUModelRunner")
    runner = runner_cls.__new__(runner_cls)
    steps: list[str] = []
    produced = torch.randn(TOKENS, HIDDEN)
    hidden_states = produced.clone()  # the graph output: a view of pool memory in the engine
    seen: dict[str, torch.Tensor] = {}

    def propose(*args: Any, **kwargs: Any) -> torch.Tensor:
        steps.append("draft")
        hidden_states.fill_(-7.0)  # the drafter's graph replay reusing the pool memory of the target's output
        return torch.zeros(1, 5, dtype=torch.int64)

    def compute_prompt_logprobs(compute_logits, hidden, *args: Any) -> dict:
        steps.append("prompt_logprobs")
        seen["hidden"] = hidden[:TOKENS].clone()
        raise _PromptLogprobsReached

    batch = SimpleNamespace(req_ids=["r0"], idx_mapping=torch.zeros(1, dtype=torch.int32),
                            logits_indices=torch.tensor([TOKENS - 1]),
                            query_start_loc=torch.tensor([0, TOKENS], dtype=torch.int32))
    # The release's own ExecuteModelState fields, each None but these (0.31.0 names the DP state dp_sync,
    # 0.33.0 dp_sync_state and adds num_spec_tokens_to_schedule): a hand list fits one release only.
    given = dict(input_batch=batch, hidden_states=hidden_states, finished_req_ids=set(), num_spec_tokens_to_schedule=5)
    names = compat.symbol("gpu_model_runner_v2", "ExecuteModelState")._fields
    runner.execute_model_state = SimpleNamespace(**{name: given.get(name) for name in names})
    runner.is_last_pp_rank = True
    runner.pcp_manager = None
    runner.pp_handler = None
    runner.speculative_config = spec_config
    runner.speculator = SimpleNamespace(propose=propose, supports_mm_inputs=False)
    runner.sample = lambda hidden, input_batch, grammar: (
        SimpleNamespace(sampled_token_ids=torch.zeros(1, 6, dtype=torch.int64)),
        torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    runner.prompt_logprobs_worker = SimpleNamespace(compute_prompt_logprobs=compute_prompt_logprobs)
    runner.model = SimpleNamespace(compute_logits=lambda hidden: hidden)
    runner.req_states = SimpleNamespace(all_token_ids=SimpleNamespace(gpu=None),
                                        num_computed_tokens=SimpleNamespace(gpu=None),
                                        prompt_len=SimpleNamespace(np=None))
    with pytest.raises(_PromptLogprobsReached):
        runner.sample_tokens(None)
    return produced, seen["hidden"], steps


@pytest.mark.parametrize("env", [None, "0", "1"], ids=["release-default", "v1-forced", "v2-forced"])
def test_prompt_logprobs_see_the_target_hidden_states_on_the_runner_the_engine_gets(
        configs, env: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    vc, spec = configs
    runner = _runner(vc, env, monkeypatch)
    if env is not None:
        assert runner == ("v2" if env == "1" else "v1")
    if runner == "v1":
        produced, seen, steps = v1._run_until_bookkeeping(spec, prompt_logprobs=True)
        assert steps == ["draft", "bookkeeping"]  # V1 drafts first: the patch's copy is what keeps them
    else:
        produced, seen, steps = _run_v2_until_prompt_logprobs(spec)
        assert steps == ["prompt_logprobs"]  # V2: before its speculator proposes
    torch.testing.assert_close(seen, produced, rtol=0, atol=0)
