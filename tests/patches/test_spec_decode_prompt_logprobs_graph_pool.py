"""spec-decode-prompt-logprobs-graph-pool: prompt logprobs read the target's hidden states, not the drafter's.

On 0.28.0 ``GPUModelRunner.sample_tokens`` runs the padded GPU drafter (MTP / EAGLE) before
``_bookkeeping_sync``, which computes prompt logprobs from the target step's hidden states.
Under CUDA graphs those hidden states are a weak reference into the graphs' shared memory pool,
and the drafter's graph replays write over that memory. The test drives vLLM's own
``sample_tokens`` with a drafter that does exactly that (writes into the storage of the hidden
states it is given) and records what bookkeeping computes the prompt logprobs from. The model
forward, sampler and drafter are stand-ins at their call boundary; the order of the steps and the
speculative config (vLLM's MTP ``SpeculativeConfig``) are vLLM's.
"""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace
from typing import Any

import compat
import pytest
import sparse_dcp_harness as h
import torch

TOKENS, HIDDEN = 12, 16


class _BookkeepingReached(Exception):
    """Raised by the bookkeeping stand-in once it has recorded its input."""


@pytest.fixture(scope="module")
def spec_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    root = tmp_path_factory.mktemp("glm5-mtp")
    (root / "config.json").write_text(json.dumps({**h.glm5_config(), "num_nextn_predict_layers": 1}))
    model = ModelConfig(model=str(root), tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                        max_model_len=4096)
    return SpeculativeConfig(method="mtp", num_speculative_tokens=5, target_model_config=model,
                             target_parallel_config=ParallelConfig())


def v1_runner_cls() -> Any:
    """Model Runner V1's ``GPUModelRunner``, where the patch is. A release that removed V1 (0.34.0:
    ``platforms/interface.py``, "Model Runner V1 has been removed") has nothing for it to patch: the
    test does not apply there (skipped, with that reason)."""
    if importlib.util.find_spec(compat.module_path("gpu_model_runner")) is None:
        pytest.skip("Model Runner V1 has been removed in this release (no vllm/v1/worker/gpu_model_runner.py): "
                    "the patch has nothing to patch")
    return compat.symbol("gpu_model_runner", "GPUModelRunner")


def _run_until_bookkeeping(spec_config: Any, prompt_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Drive ``sample_tokens`` of a bare runner; return (target hidden states as produced, what
    bookkeeping got, the order of the steps)."""
    runner_cls = v1_runner_cls()
    eagle_cls = compat.symbol("eagle", "EagleProposer")
    runner = runner_cls.__new__(runner_cls)
    steps: list[str] = []
    produced = torch.randn(TOKENS, HIDDEN)
    hidden_states = produced.clone()  # the graph output: a view of pool memory in the engine
    seen: dict[str, torch.Tensor] = {}

    def propose(scheduler_output, sampled, sampling_metadata, hidden, *args: Any) -> torch.Tensor:
        steps.append("draft")
        hidden.fill_(-7.0)  # the drafter's graph replay reusing the pool memory of the target's output
        return torch.zeros(1, 5, dtype=torch.int32)

    def bookkeeping(scheduler_output, sampler_output, logits, hidden, num_tokens):
        steps.append("bookkeeping")
        seen["hidden"] = hidden[:num_tokens].clone()
        raise _BookkeepingReached

    scheduler_output = SimpleNamespace(total_num_scheduled_tokens=TOKENS, num_scheduled_tokens={"r0": TOKENS})
    runner.execute_model_state = (scheduler_output, torch.zeros(1, 8), None, object(), hidden_states,
                                  hidden_states[-1:], None, None, None, None)
    runner.use_async_scheduling = False
    runner.input_batch = SimpleNamespace(prev_sampled_token_ids=None, sampling_metadata=None)
    runner.speculative_config = spec_config
    runner.drafter = eagle_cls.__new__(eagle_cls)
    runner.parallel_config = SimpleNamespace(data_parallel_size=1)
    runner.valid_sampled_token_count_event = None
    runner.num_prompt_logprobs = {"r0": 5} if prompt_logprobs else {}
    runner._sample = lambda logits, meta: SimpleNamespace(sampled_token_ids=torch.zeros(1, 1, dtype=torch.int32))
    runner._update_states_after_model_execute = lambda *a, **k: None
    runner._input_fits_in_drafter = lambda meta: True
    runner.propose_draft_token_ids = propose
    runner._copy_draft_token_ids_to_cpu = lambda *a, **k: None
    runner._bookkeeping_sync = bookkeeping
    with pytest.raises(_BookkeepingReached):
        runner.sample_tokens(None)
    return produced, seen["hidden"], steps


def test_prompt_logprobs_see_the_target_hidden_states(spec_config: Any) -> None:
    produced, seen, steps = _run_until_bookkeeping(spec_config, prompt_logprobs=True)
    assert steps == ["draft", "bookkeeping"]  # the padded drafter runs first, as in the engine
    torch.testing.assert_close(seen, produced, rtol=0, atol=0)  # base: the drafter's -7.0


def test_no_copy_without_prompt_logprobs(spec_config: Any) -> None:
    """Steps without prompt logprobs hand bookkeeping the hidden states as they are (no copy)."""
    _, seen, steps = _run_until_bookkeeping(spec_config, prompt_logprobs=False)
    assert steps == ["draft", "bookkeeping"]
    assert bool((seen == -7.0).all())
