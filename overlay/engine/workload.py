"""The engine check's workload and cases: which prompts, which engine configurations, in what order.

One batch holds long prompts beside short ones, sent at once so the scheduler mixes chunked
prefills with decodes: about 100 tokens, 3000 (beyond ``index_topk`` = 2048, so the indexer
really selects) and 9000 (beyond the direct DCP workspaces' decode-sized capacity and beyond
one 8192-token scheduler step), plus short prompts that start decoding while the long ones are
still prefilling. Every request asks for prompt logprobs (the forced-MQA prefill rows of the
DCP combine) and 64 greedy steps with top-5 logprobs. Prompt tokens are seeded random bytes.

A case is one engine configuration; ``CASES`` lists them in the order of their value (the
production shape first, after the references), so a run cut short by the device's time limits
still answers the most important question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

PROMPT_LENS = (100, 3000, 9000, 8, 16, 24, 40)
# The long cases: one prompt of about 60,000 tokens, then DECODE_STEPS decode steps (upstream
# #46145: a hang at the first decode after a ~131K-token prefill with FULL graphs and DCP > 1).
LONG_PROMPT_LENS = (60000,)
DECODE_STEPS = 64
TOP_LOGPROBS = 5
MAX_MODEL_LEN = 9216 + 128
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 8192
# Sequential MTP drafting: vLLM 0.28.0's parallel drafting needs a draft model with a `mask_hidden`
# buffer (EAGLE-3 / PARD); DeepSeekMTP has none and the engine stops at start-up with
# "AttributeError: 'DeepSeekMTP' object has no attribute 'mask_hidden'" (two H200s, 2026-11-30).
MTP = {"method": "mtp", "num_speculative_tokens": 5}
# CUDA graphs up to 128 tokens: every decode step of the workload (7 requests x (1 + 5) with
# MTP) fits, and start-up captures 4x fewer sizes than vLLM's default 512.
MAX_CUDAGRAPH_CAPTURE_SIZE = 128
# A fixed KV cache per GPU instead of vLLM's free-memory profiling: engines of the check run side
# by side on the same GPUs (``engine.check --parallel``), and a profile would count the others'
# allocations as its own. 2 GiB holds about 600k tokens of this checkpoint (fp8_ds_mla 656 B +
# indexer 132 B per token and layer, 4 layers with MTP); the workload needs 13k.
KV_CACHE_BYTES = 2 << 30
# What vLLM checks is free at start-up (with KV_CACHE_BYTES it reserves nothing else by it):
# low enough for six engines side by side on one 140 GiB H200.
GPU_MEMORY_UTILIZATION = 0.12


def prompts(seed: int = 0, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    """The prompts as token ids (byte tokens 0..255 of the generated checkpoint's tokenizer)."""
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lens]


@dataclass(frozen=True)
class Case:
    """One engine configuration of the check.

    ``role``: ``reference`` (DCP 1, what every other case is compared with), ``spread`` (a DCP 1
    rerun that measures rounding noise), ``check`` (must match the reference) or ``expect-fail``
    (a seed-bug variant: must fail, see ``engine.check``).
    """

    name: str
    role: str = "check"
    tp: int = 2
    dcp: int = 1
    backend: str = "ag_rs"
    eager: bool = False
    mtp: bool = False
    env: dict[str, str] = field(default_factory=dict)
    reverse: bool = False  # submit the prompts in reverse order (another batch composition)
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    note: str = ""
    compare_to: str = ""  # the reference case it is compared with ("": the first reference)
    interleave: int = 1  # cp_kv_cache_interleave_size (DCP only)
    # the CUDA-graph mode its log must show (``engine.check.graph_mode``): "FULL" (decode steps,
    # MTP's (1 + k)-token ones included, captured in FULL graphs), "PIECEWISE" (spec decoding
    # resolved to piecewise), "" (not judged: eager)
    graphs: str = ""
    prompt_lens: tuple[int, ...] = PROMPT_LENS  # the workload's prompts (LONG_PROMPT_LENS: the long cases)

    def engine_kwargs(self, model: str) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "model": model,
            "tokenizer": model,
            "tensor_parallel_size": self.tp,
            "kv_cache_dtype": "fp8_ds_mla",
            "max_model_len": self.max_model_len,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_prefix_caching": False,
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
            "kv_cache_memory_bytes": KV_CACHE_BYTES,
            "enforce_eager": self.eager,
            "seed": 0,
            "disable_log_stats": False,
        }
        if not self.eager:
            kw["compilation_config"] = {"max_cudagraph_capture_size": MAX_CUDAGRAPH_CAPTURE_SIZE}
        if self.dcp > 1:
            kw["decode_context_parallel_size"] = self.dcp
            kw["dcp_comm_backend"] = self.backend
            if self.interleave > 1:
                kw["cp_kv_cache_interleave_size"] = self.interleave
        if self.mtp:
            kw["speculative_config"] = dict(MTP)
        return kw

    @property
    def max_model_len(self) -> int:
        """MAX_MODEL_LEN, or the longest prompt + the decode steps + 128 for other prompts."""
        if tuple(self.prompt_lens) == PROMPT_LENS:
            return MAX_MODEL_LEN
        return max(self.prompt_lens) + DECODE_STEPS + 128

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "tp": self.tp, "dcp": self.dcp, "backend": self.backend,
                "eager": self.eager, "mtp": self.mtp, "env": dict(self.env), "reverse": self.reverse,
                "max_num_batched_tokens": self.max_num_batched_tokens, "note": self.note,
                **({"compare_to": self.compare_to} if self.compare_to else {}),
                **({"interleave": self.interleave} if self.interleave > 1 else {}),
                **({"graphs": self.graphs} if self.graphs else {}),
                **({"prompt_lens": list(self.prompt_lens)} if tuple(self.prompt_lens) != PROMPT_LENS else {})}


def _dcp(name: str, *, backend: str = "a2a", direct: bool = True, project: bool = True, eager: bool = False,
         mtp: bool = False, sizing: str | None = None, tp: int = 2, dcp: int = 2, interleave: int = 1,
         long: bool = False) -> Case:
    env = {"VLLM_DCP_PROJECT_BEFORE_MERGE": "1" if project else "0"}
    if backend == "a2a":
        env["VLLM_USE_DIRECT_DCP_A2A"] = "1" if direct else "0"
    if sizing:
        env["VLLM_DCP_DIRECT_WORKSPACE_SIZING"] = sizing
    # MTP under DCP: (1 + k)-token steps are decodes in FULL graphs with interleave 1, prefills
    # (spec decoding piecewise) with interleave > 1 (flashmla-sparse-dcp-spec-cudagraphs)
    graphs = "" if eager or not mtp else ("FULL" if interleave == 1 else "PIECEWISE")
    ref = ("ref-dcp1-mtp-long" if long else "ref-dcp1-mtp") if mtp else ""
    return Case(name, tp=tp, dcp=dcp, backend=backend, eager=eager, mtp=mtp, env=env, compare_to=ref,
                interleave=interleave, graphs=graphs, prompt_lens=LONG_PROMPT_LENS if long else PROMPT_LENS)


def cases(tp: int = 2) -> list[Case]:
    """Every case for TP ``tp`` (DCP = TP), references first, then by value.

    With ``tp == 1`` only the DCP 1 cases remain (a one-GPU machine cannot run DCP).
    """
    refs = [
        Case("ref-dcp1", role="reference", tp=tp),
        Case("ref-dcp1-rerun", role="spread", tp=tp, note="identical rerun: run-to-run noise"),
        Case("ref-dcp1-reordered", role="spread", tp=tp, reverse=True, max_num_batched_tokens=4096,
             note="prompts reversed, 4096-token steps: other batches, same math (rounding spread)"),
        # The reference of the MTP cases: vLLM 0.28.0 with MTP moved the first request's prompt
        # logprobs by up to 11 nats at DCP 1 already (two H200s, 2026-11-30), so MTP cases are held
        # to DCP 1 + MTP. With spec-decode-prompt-logprobs-graph-pool it must also agree with
        # ref-dcp1 (prompt logprobs come from the target alone): judged against it.
        Case("ref-dcp1-mtp", role="reference", tp=tp, mtp=True, graphs="FULL",
             note="MTP-5 (sequential drafting) at DCP 1, FULL decode graphs"),
    ]
    # MTP in graphs against MTP eager: the graph mode changes nothing but the speed
    mtp_eager = Case("ref-dcp1-mtp-eager", tp=tp, mtp=True, eager=True, compare_to="ref-dcp1-mtp",
                     note="MTP-5 at DCP 1, eager: the graph run must agree with it")
    if tp < 2:
        return [*refs, mtp_eager]
    d = {"tp": tp, "dcp": tp}
    checks = [
        _dcp("dcp-a2a-direct-proj1-graph-mtp", mtp=True, **d),  # the production shape
        _dcp("dcp-a2a-direct-proj1-graph", **d),
        _dcp("dcp-a2a-nccl-proj1-graph", direct=False, **d),
        _dcp("dcp-agrs-proj1-graph", backend="ag_rs", **d),
        _dcp("dcp-a2a-direct-proj0-graph", project=False, **d),
        _dcp("dcp-a2a-direct-sizing-mnbt-graph", sizing="max_num_batched_tokens", **d),
        _dcp("dcp-agrs-proj1-graph-mtp", backend="ag_rs", mtp=True, **d),
        _dcp("dcp-a2a-direct-proj1-eager", eager=True, **d),
        _dcp("dcp-a2a-nccl-proj0-graph", direct=False, project=False, **d),
        _dcp("dcp-agrs-proj0-graph", backend="ag_rs", project=False, **d),
        _dcp("dcp-a2a-nccl-proj1-eager", direct=False, eager=True, **d),
        _dcp("dcp-agrs-proj1-eager", backend="ag_rs", eager=True, **d),
        _dcp("dcp-a2a-direct-proj0-eager", project=False, eager=True, **d),
        # interleave > 1: MTP steps are prefills, spec decoding piecewise (the capture crash's shape)
        _dcp("dcp-a2a-direct-proj1-graph-mtp-il16", mtp=True, interleave=16, **d),
        mtp_eager,
        # a ~60,000-token prefill, then decodes in FULL graphs, on each transport (#46145's hang)
        Case("ref-dcp1-mtp-long", role="reference", tp=tp, mtp=True, graphs="FULL", prompt_lens=LONG_PROMPT_LENS,
             note="one ~60,000-token prompt, MTP-5 at DCP 1: the long cases' reference"),
        _dcp("dcp-a2a-direct-proj1-graph-mtp-long", mtp=True, long=True, **d),
        _dcp("dcp-a2a-nccl-proj1-graph-mtp-long", direct=False, mtp=True, long=True, **d),
        _dcp("dcp-agrs-proj1-graph-mtp-long", backend="ag_rs", mtp=True, long=True, **d),
    ]
    # the references, the production shape, a spread run (the tolerance), then by value
    return [refs[0], refs[3], checks[0], refs[2], checks[1], checks[2], checks[3], refs[1], *checks[4:]]
