"""Plan the direct DCP symmetric-memory workspaces of a serving configuration.

vLLM 0.28.0 allocates, per GPU and at start-up, two symmetric-memory buffers for MLA decode
context parallelism (``vllm/v1/attention/ops/dcp_utils.py``):

- the **A2A** ``lse_reduce`` workspace (``DirectDCPA2AWorkspace``): output
  ``[ubatches, 2, DCP, T, H, kv_lora_rank]`` in the model dtype, LSE ``[ubatches, 2, DCP, T, H]``
  float32, signals ``[ubatches, 2, DCP]`` int32;
- the **q-gather** workspace (``DirectDCPQGatherWorkspace``): query
  ``[ubatches, T, P, kv_lora_rank + rope_dim]`` in the query dtype, signals
  ``[ubatches, 2, DCP]`` int32;

where ``H`` is the attention heads per TP rank (``num_heads / TP``), ``P`` the padded
gathered heads (``DCP * H`` unless the backend pads the query, e.g. FlashMLA's fp8 decode to
64 or 128), and ``T`` the token capacity of ``get_dcp_workspace_max_num_tokens``:

- ``decode`` sizing (0.28.0's only one, still the default):
  ``min(max_num_batched_tokens, max(max_num_seqs * (1 + k * s), cudagraph_capture))`` with
  ``s`` speculative tokens, ``k = 2`` with parallel drafting else 1;
- ``max_num_batched_tokens`` sizing (our ``dcp-direct-a2a-fallback.patch``, opt-in with
  ``VLLM_DCP_DIRECT_WORKSPACE_SIZING=max_num_batched_tokens``): ``T = max_num_batched_tokens``.

Steps above the decode capacity (sparse-MLA forced-MQA prefill) take the NCCL paths with the
patched series; on the unpatched 0.28.0 they crash. Sizes here are the requested bytes; the
symmetric-memory allocator may round each buffer up. ``tests/test_workspace_plan.py`` checks
these formulas against vLLM's own functions and workspace constructors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

SIZINGS = ("decode", "max_num_batched_tokens")
_SIGNAL_BYTES = 4  # int32
_LSE_BYTES = 4  # float32


HOPPER_DEFAULT_MAX_CAPTURE = 512
SERVE_DEFAULT_MAX_NUM_SEQS = 1024
SERVE_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def tokens_per_seq(speculative_tokens: int = 0, parallel_drafting: bool = False) -> int:
    """Query tokens one decode sequence brings to a step: 1 + s (2s with parallel drafting)."""
    return 1 + (2 if parallel_drafting else 1) * speculative_tokens


def capacity_tokens(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    speculative_tokens: int = 0,
    parallel_drafting: bool = False,
    cudagraph_capture_size: int | None = None,
    sizing: str = "decode",
) -> int:
    """Token capacity of both direct DCP workspaces (vLLM's ``get_dcp_workspace_max_num_tokens``).

    ``sizing="decode"`` is vLLM 0.28.0's formula
    ``min(max_num_batched_tokens, max(max_num_seqs * tokens_per_seq, cudagraph_capture_size))``;
    ``sizing="max_num_batched_tokens"`` is the patched series' opt-in mode
    (``VLLM_DCP_DIRECT_WORKSPACE_SIZING``), which returns ``max_num_batched_tokens``. A step
    with more MQA tokens than this overflows the direct workspaces (the NCCL fallback then
    serves it on the patched build). Example, the seed's production setup: 128 sequences,
    MTP-5 with parallel drafting, 8192 batched tokens -> 1408 (decode) / 8192.
    """
    if sizing not in SIZINGS:
        raise ValueError(f"sizing must be one of {SIZINGS}, got {sizing!r}")
    if sizing == "max_num_batched_tokens":
        return max_num_batched_tokens
    return min(
        max_num_batched_tokens,
        max(max_num_seqs * tokens_per_seq(speculative_tokens, parallel_drafting),
            cudagraph_capture_size or 0),
    )


def a2a_workspace_bytes(tokens: int, dcp: int, heads_per_rank: int, head_dim: int,
                        dtype_bytes: int = 2, num_ubatches: int = 1) -> int:
    """Bytes of one GPU's ``DirectDCPA2AWorkspace`` (output + LSE + signals)."""
    slots = num_ubatches * 2 * dcp
    return (slots * tokens * heads_per_rank * head_dim * dtype_bytes
            + slots * tokens * heads_per_rank * _LSE_BYTES
            + slots * _SIGNAL_BYTES)


def q_gather_workspace_bytes(tokens: int, dcp: int, heads_per_rank: int, head_dim: int,
                             dtype_bytes: int = 2, num_ubatches: int = 1,
                             padded_num_heads: int | None = None) -> int:
    """Bytes of one GPU's ``DirectDCPQGatherWorkspace`` (padded gathered query + signals)."""
    heads = dcp * heads_per_rank if padded_num_heads is None else padded_num_heads
    return num_ubatches * tokens * heads * head_dim * dtype_bytes + num_ubatches * 2 * dcp * _SIGNAL_BYTES


FLAGS = {"tp": "--tp", "dcp": "--dcp", "num_heads": "--num-heads", "kv_lora_rank": "--kv-lora-rank",
         "qk_rope_head_dim": "--rope-dim", "max_num_seqs": "--max-num-seqs",
         "speculative_tokens": "--speculative-tokens", "parallel_drafting": "--parallel-drafting",
         "max_num_batched_tokens": "--max-num-batched-tokens", "cudagraph_capture_size": "--cudagraph-capture-size",
         "num_ubatches": "--num-ubatches", "output_dtype_bytes": "output_dtype_bytes",
         "query_dtype_bytes": "--query-dtype-bytes", "q_padded_heads": "--q-padded-heads"}
"""The ``overlay workspace-plan`` flag of each field, for messages."""
POSITIVE = ("tp", "dcp", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "max_num_seqs",
            "max_num_batched_tokens", "num_ubatches")
NON_NEGATIVE = ("speculative_tokens",)
OPTIONAL_POSITIVE = ("cudagraph_capture_size", "q_padded_heads")
DTYPE_BYTES = (1, 2, 4)


def _flag(name: str) -> str:
    flag = FLAGS.get(name, name)
    return flag if flag == name else f"{flag} ({name})"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field_problems(config: ServingConfig) -> list[str]:
    """Each field alone: counts are positive integers, dtype sizes 1, 2 or 4 bytes."""
    problems: list[str] = []
    for name in POSITIVE + OPTIONAL_POSITIVE:
        value = getattr(config, name)
        if name in OPTIONAL_POSITIVE and value is None:
            continue
        if not _is_int(value) or value < 1:
            problems.append(f"{_flag(name)} must be a positive integer, got {value!r}")
    for name in NON_NEGATIVE:
        value = getattr(config, name)
        if not _is_int(value) or value < 0:
            problems.append(f"{_flag(name)} must be 0 or a positive integer, got {value!r}")
    for name in ("output_dtype_bytes", "query_dtype_bytes"):
        value = getattr(config, name)
        if not _is_int(value) or value not in DTYPE_BYTES:
            problems.append(f"{_flag(name)} must be 1, 2 or 4 (fp8, bf16/fp16, fp32), got {value!r}")
    if not isinstance(config.parallel_drafting, bool):
        problems.append(f"{_flag('parallel_drafting')} must be true or false, got {config.parallel_drafting!r}")
    return problems


def _layout_problems(c: ServingConfig) -> list[str]:
    """How the fields fit together (only once each field is valid on its own)."""
    problems: list[str] = []
    if c.num_heads % c.tp:
        problems.append(f"{_flag('num_heads')} {c.num_heads} must be divisible by --tp {c.tp}")
    if c.tp % c.dcp:
        problems.append(f"{_flag('dcp')} must divide --tp {c.tp} (1, "
                        + ", ".join(str(d) for d in range(2, c.tp + 1) if c.tp % d == 0) + f"), got {c.dcp}")
    if c.max_num_batched_tokens < c.max_num_seqs:
        problems.append(f"--max-num-batched-tokens ({c.max_num_batched_tokens}) must be at least --max-num-seqs "
                        f"({c.max_num_seqs}), as vLLM requires")
    gathered = c.dcp * (c.num_heads // c.tp)
    if not problems and c.q_padded_heads is not None and c.q_padded_heads < gathered:
        problems.append(f"{_flag('q_padded_heads')} must be at least DCP x heads per rank ({gathered}), "
                        f"got {c.q_padded_heads}")
    return problems


def config_problems(config: ServingConfig) -> list[str]:
    """Every problem of ``config``, each naming the field (and its flag) and what is accepted."""
    return _field_problems(config) or _layout_problems(config)


@dataclass(frozen=True)
class ServingConfig:
    """The serving parameters that size the workspaces (defaults: GLM-5.x, one H200/H100 node)."""

    tp: int = 8
    dcp: int = 8
    num_heads: int = 64  # attention heads of the model (all TP ranks)
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    max_num_seqs: int = 128
    speculative_tokens: int = 0
    parallel_drafting: bool = False
    max_num_batched_tokens: int = 8192
    cudagraph_capture_size: int | None = None
    num_ubatches: int = 1
    output_dtype_bytes: int = 2  # bf16 model dtype
    query_dtype_bytes: int = 2  # bf16 (fp8_ds_mla keeps the query in the model dtype)
    q_padded_heads: int | None = None

    def __post_init__(self) -> None:
        problems = config_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp

    @property
    def effective_cudagraph_capture_size(self) -> int:
        """The capture size vLLM 0.28.0 uses: the given one, else its Hopper default.

        ``VllmConfig._set_cudagraph_sizes`` picks ``min(max_num_seqs * (1 + speculative
        tokens) * 2, 512)`` (1024 on Blackwell), capped by the batched tokens, when
        ``--max-cudagraph-capture-size`` is not given.
        """
        if self.cudagraph_capture_size is not None:
            return self.cudagraph_capture_size
        return min(self.max_num_seqs * (1 + self.speculative_tokens) * 2, HOPPER_DEFAULT_MAX_CAPTURE,
                   self.max_num_batched_tokens)


@dataclass(frozen=True)
class SizingRow:
    sizing: str
    tokens: int
    q_gather_bytes: int
    a2a_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.q_gather_bytes + self.a2a_bytes


@dataclass(frozen=True)
class Plan:
    config: ServingConfig
    rows: list[SizingRow] = field(default_factory=list)

    def row(self, sizing: str) -> SizingRow:
        return next(r for r in self.rows if r.sizing == sizing)

    def to_dict(self) -> dict[str, Any]:
        rows = [dict(asdict(r), total_bytes=r.total_bytes) for r in self.rows]
        base, full = self.row("decode"), self.row("max_num_batched_tokens")
        delta = {"tokens": full.tokens - base.tokens,
                 "q_gather_bytes": full.q_gather_bytes - base.q_gather_bytes,
                 "a2a_bytes": full.a2a_bytes - base.a2a_bytes,
                 "total_bytes": full.total_bytes - base.total_bytes}
        return {"config": asdict(self.config), "rows": rows, "delta": delta}


def plan(config: ServingConfig) -> Plan:
    """Capacity and per-GPU bytes of both workspaces under both sizing modes."""
    rows = []
    for sizing in SIZINGS:
        tokens = capacity_tokens(config.max_num_seqs, config.max_num_batched_tokens,
                                 config.speculative_tokens, config.parallel_drafting,
                                 config.effective_cudagraph_capture_size, sizing)
        rows.append(SizingRow(
            sizing=sizing, tokens=tokens,
            q_gather_bytes=q_gather_workspace_bytes(
                tokens, config.dcp, config.heads_per_rank, config.kv_lora_rank + config.qk_rope_head_dim,
                config.query_dtype_bytes, config.num_ubatches, config.q_padded_heads),
            a2a_bytes=a2a_workspace_bytes(tokens, config.dcp, config.heads_per_rank, config.kv_lora_rank,
                                          config.output_dtype_bytes, config.num_ubatches),
        ))
    return Plan(config, rows)


def _mb(n: int) -> str:
    return f"{n / 1e6:9.1f} MB ({n / 2**20:7.1f} MiB)"


def format_plan(p: Plan) -> str:
    """A short human-readable table."""
    c = p.config
    spec = (f"{c.speculative_tokens} speculative tokens"
            + (" (parallel drafting)" if c.parallel_drafting else "")) if c.speculative_tokens else "no speculation"
    q_heads = c.q_padded_heads or c.dcp * c.heads_per_rank
    lines = [
        f"TP {c.tp}, DCP {c.dcp}, {c.num_heads} heads ({c.heads_per_rank} per TP rank), "
        f"kv_lora_rank {c.kv_lora_rank}, rope {c.qk_rope_head_dim}",
        f"max_num_seqs {c.max_num_seqs}, {spec} -> {tokens_per_seq(c.speculative_tokens, c.parallel_drafting)}"
        f" tokens/seq; max_num_batched_tokens {c.max_num_batched_tokens}; "
        f"cudagraph capture {c.effective_cudagraph_capture_size}"
        f"{'' if c.cudagraph_capture_size is not None else ' (vLLM default)'}; ubatches {c.num_ubatches}",
        f"q-gather: {q_heads} query heads x {c.kv_lora_rank + c.qk_rope_head_dim} x {c.query_dtype_bytes} B; "
        f"A2A: {c.dcp} ranks x 2 buffers x {c.heads_per_rank} heads x {c.kv_lora_rank} x "
        f"{c.output_dtype_bytes} B (+ fp32 LSE)",
        "",
        f"{'sizing':<24} {'tokens':>7}  {'q-gather / GPU':>28}  {'A2A / GPU':>28}",
    ]
    for r in p.rows:
        lines.append(f"{r.sizing:<24} {r.tokens:>7}  {_mb(r.q_gather_bytes)}  {_mb(r.a2a_bytes)}")
    d = p.to_dict()["delta"]
    lines.append(f"{'delta':<24} {d['tokens']:>+7}  {_mb(d['q_gather_bytes'])}  {_mb(d['a2a_bytes'])}")
    lines.append("")
    lines.append("decode sizing: steps above the capacity use the NCCL fallback (patched); "
                 "VLLM_DCP_DIRECT_WORKSPACE_SIZING=max_num_batched_tokens keeps every step direct.")
    return "\n".join(lines) + "\n"


def config_from_profile(name_or_path: str) -> dict[str, Any]:
    """The sizing parameters a regress profile's ``vllm serve`` arguments set (others absent)."""
    from overlay.regress.profiles import load_profile

    server = load_profile(name_or_path).server
    # What `vllm serve` 0.28.0 uses on H100/H200 (>= 70 GiB, not A100) when a flag is absent
    # (EngineArgs: OPENAI_API_SERVER defaults), so an unset flag is sized as served.
    found: dict[str, Any] = {"max_num_seqs": SERVE_DEFAULT_MAX_NUM_SEQS,
                             "max_num_batched_tokens": SERVE_DEFAULT_MAX_NUM_BATCHED_TOKENS}
    for key, flags in (("tp", ("--tensor-parallel-size", "-tp")),
                       ("dcp", ("--decode-context-parallel-size", "-dcp")),
                       ("max_num_seqs", ("--max-num-seqs",)),
                       ("max_num_batched_tokens", ("--max-num-batched-tokens",)),
                       ("cudagraph_capture_size", ("--max-cudagraph-capture-size",))):
        for flag in flags:
            value = server.arg_value(flag)
            if value is not None:
                found[key] = int(value)
                break
    spec = server.speculative_config
    if spec is not None:
        found["speculative_tokens"] = server.speculative_tokens
        if "parallel_drafting" in spec:
            found["parallel_drafting"] = bool(spec["parallel_drafting"])
    return found


def build_config(profile: str | None = None, **overrides: Any) -> ServingConfig:
    """ServingConfig from defaults, then a profile's serve arguments, then explicit overrides."""
    values: dict[str, Any] = config_from_profile(profile) if profile else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return replace(ServingConfig(), **values)
