"""Plan the direct DCP symmetric-memory workspaces and the DCP-gathered W_UV of a serving configuration.

With decode context parallelism (DCP > 1) vLLM 0.28.0 allocates, per GPU and at start-up, two
symmetric-memory buffers for MLA (``vllm/v1/attention/ops/dcp_utils.py``, one of each per GPU,
shared by the layers):

- the **A2A** ``lse_reduce`` workspace (``DirectDCPA2AWorkspace``, ``--dcp-comm-backend a2a``):
  output ``[ubatches, 2, DCP, T, H, D]`` in the model dtype, LSE ``[ubatches, 2, DCP, T, H]``
  float32, signals ``[ubatches, 2, DCP]`` int32;
- the **q-gather** workspace (``DirectDCPQGatherWorkspace``): query
  ``[ubatches, T, P, kv_lora_rank + rope_dim]`` in the query dtype, signals
  ``[ubatches, 2, DCP]`` int32;

where ``H`` is the attention heads per TP rank (``num_heads / TP``), ``P`` the padded
gathered heads (``DCP * H`` unless the backend pads the query, e.g. FlashMLA's fp8 decode to
64 or 128), ``T`` the token capacity of ``get_dcp_workspace_max_num_tokens``, the decode formula
``min(max_num_batched_tokens, max(max_num_seqs * (1 + k * s), cudagraph_capture))`` with ``s``
speculative tokens, ``k = 2`` with parallel drafting else 1, and ``D`` the head dimension the
DCP manager's combine is built for: ``v_head_dim`` while the layers project through ``W_UV`` before the
merge, ``kv_lora_rank`` while they do not. Steps above the capacity (sparse-MLA forced-MQA prefill) take the
NCCL paths with the patched series; on the unpatched 0.28.0 they crash.

With the projection on, every MLA layer also all-gathers ``W_UV`` over the DCP group in
``process_weights_after_loading``: ``W_UV_dcp`` ``[DCP * H, kv_lora_rank, v_head_dim]`` in the
model dtype, ``(DCP - 1) * H * kv_lora_rank * v_head_dim * dtype_bytes`` bytes more per layer and
GPU than ``W_UV`` alone (GLM-5 at TP8 x DCP8: 14 MiB, 1092 MiB over its 78 layers). It is
allocated inside vLLM's model loader, so vLLM counts it in the model's weight memory before it
sizes the KV cache. At DCP 1 there is no DCP manager: no workspace, no ``W_UV_dcp``.

The projection's switch is spelled per build (``overlay/releases/projection.py``): our 0.28.0 series reads
``VLLM_DCP_PROJECT_BEFORE_MERGE`` (1 on, 0 off, unset on), our 0.34.0 series the engine argument
``--dcp-v-up-proj-before-merge auto|on|off`` and not the variable. A profile's server is read in either
spelling, never both (a build reads one: the other would be ignored). ``auto`` is resolved as 0.34.0's series
resolves it for the profile's transport (:func:`auto_projects`): projected over the NCCL All-to-All only,
not over ag_rs nor the direct symmetric-memory A2A. Without either the plan projects (0.28.0's default, and
``--project-before-merge``'s), and says so.

Sizes here are the requested bytes; the symmetric-memory allocator may round each buffer up.
``tests/test_workspace_plan.py`` checks the capacity and workspace formulas against vLLM's own
function and workspace constructors.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from overlay.errors import one_line, shown
from overlay.releases.derive import DIRECT_A2A_ENV, PROJECTION_ENV
from overlay.releases.projection import ARGUMENT as PROJECT_ARG
from overlay.releases.projection import VALUES as PROJECT_VALUES

if TYPE_CHECKING:
    from overlay.regress.profiles import ServerSpec

_SIGNAL_BYTES = 4  # int32
_LSE_BYTES = 4  # float32


HOPPER_DEFAULT_MAX_CAPTURE = 512
SERVE_DEFAULT_MAX_NUM_SEQS = 1024
SERVE_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
COMM_BACKEND_ARG = "--dcp-comm-backend"
COMM_BACKENDS = ("ag_rs", "a2a")
AUTO_DEFAULT_BACKEND = "a2a"
"""GLM-5's comm backend on 0.34.0 when none is named (its config hook's ``set_dcp_defaults(comm_backend="a2a")``;
``ReleaseFacts.dcp_comm_backend``): what ``auto`` is resolved for without ``--dcp-comm-backend``."""


def tokens_per_seq(speculative_tokens: int = 0, parallel_drafting: bool = False) -> int:
    """Query tokens one decode sequence brings to a step: 1 + s (2s with parallel drafting)."""
    return 1 + (2 if parallel_drafting else 1) * speculative_tokens


def capacity_tokens(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    speculative_tokens: int = 0,
    parallel_drafting: bool = False,
    cudagraph_capture_size: int | None = None,
) -> int:
    """Token capacity of both direct DCP workspaces (vLLM's ``get_dcp_workspace_max_num_tokens``).

    The decode formula ``min(max_num_batched_tokens, max(max_num_seqs * tokens_per_seq,
    cudagraph_capture_size))``. A step with more MQA tokens than this would overflow the direct
    workspaces; the patched series serves it on the NCCL fallback. Example, the seed's
    production setup: 128 sequences, MTP-5 with parallel drafting, 8192 batched tokens -> 1408.
    """
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


def w_uv_dcp_layer_bytes(dcp: int, heads_per_rank: int, kv_lora_rank: int, v_head_dim: int,
                         dtype_bytes: int = 2) -> int:
    """Bytes one MLA layer's ``W_UV_dcp`` adds per GPU beyond its own ``W_UV``.

    ``W_UV_dcp`` is ``W_UV`` ``[H, kv_lora_rank, v_head_dim]`` all-gathered over the DCP group,
    ``[DCP * H, kv_lora_rank, v_head_dim]`` in the model dtype: ``DCP - 1`` other ranks' heads
    (what ``dcp-project-before-merge.patch`` logs as "MiB more per MLA layer").
    """
    return (dcp - 1) * heads_per_rank * kv_lora_rank * v_head_dim * dtype_bytes


FLAGS = {"tp": "--tp", "dcp": "--dcp", "num_heads": "--num-heads", "kv_lora_rank": "--kv-lora-rank",
         "qk_rope_head_dim": "--rope-dim", "v_head_dim": "--v-head-dim", "num_layers": "--num-layers",
         "project_before_merge": "--project-before-merge", "max_num_seqs": "--max-num-seqs",
         "speculative_tokens": "--speculative-tokens", "parallel_drafting": "--parallel-drafting",
         "max_num_batched_tokens": "--max-num-batched-tokens", "cudagraph_capture_size": "--cudagraph-capture-size",
         "num_ubatches": "--num-ubatches", "output_dtype_bytes": "output_dtype_bytes",
         "query_dtype_bytes": "--query-dtype-bytes", "q_padded_heads": "--q-padded-heads"}
"""The ``overlay workspace-plan`` flag of each field, for messages."""
POSITIVE = ("tp", "dcp", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "num_layers",
            "max_num_seqs", "max_num_batched_tokens", "num_ubatches")
NON_NEGATIVE = ("speculative_tokens",)
OPTIONAL_POSITIVE = ("cudagraph_capture_size", "q_padded_heads")
BOOLEAN = ("parallel_drafting", "project_before_merge")
DTYPE_BYTES = (1, 2, 4)
MAX_COUNT = 1 << 31  # the largest count a field takes (vLLM's are 32-bit); beyond it a plan is not a server's


def _flag(name: str) -> str:
    flag = FLAGS.get(name, name)
    return flag if flag == name else f"{flag} ({name})"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field_problems(config: ServingConfig) -> list[str]:
    """Each field alone: counts are positive integers, dtype sizes 1, 2 or 4 bytes, switches booleans."""
    problems: list[str] = []
    for name in POSITIVE + OPTIONAL_POSITIVE:
        value = getattr(config, name)
        if name in OPTIONAL_POSITIVE and value is None:
            continue
        if not _is_int(value) or value < 1:
            problems.append(f"{_flag(name)} must be a positive integer, got {value!r}")
        elif value > MAX_COUNT:
            problems.append(f"{_flag(name)} must be at most {MAX_COUNT}, got {value}")
    for name in NON_NEGATIVE:
        value = getattr(config, name)
        if not _is_int(value) or value < 0:
            problems.append(f"{_flag(name)} must be 0 or a positive integer, got {value!r}")
        elif value > MAX_COUNT:
            problems.append(f"{_flag(name)} must be at most {MAX_COUNT}, got {value}")
    for name in ("output_dtype_bytes", "query_dtype_bytes"):
        value = getattr(config, name)
        if not _is_int(value) or value not in DTYPE_BYTES:
            problems.append(f"{_flag(name)} must be 1, 2 or 4 (fp8, bf16/fp16, fp32), got {value!r}")
    for name in BOOLEAN:
        value = getattr(config, name)
        if not isinstance(value, bool):
            problems.append(f"{_flag(name)} must be true or false, got {value!r}")
    if not isinstance(config.projection_source, str):
        problems.append(f"projection_source must be a string, got {config.projection_source!r}")
    return problems


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, found up to its square root (``range(2, n + 1)`` ran past a minute for 1e20)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _layout_problems(c: ServingConfig) -> list[str]:
    """How the fields fit together (only once each field is valid on its own)."""
    problems: list[str] = []
    if c.num_heads % c.tp:
        problems.append(f"{_flag('num_heads')} {c.num_heads} must be divisible by --tp {c.tp}")
    if c.tp % c.dcp:
        problems.append(f"{_flag('dcp')} must divide --tp {c.tp} ({', '.join(map(str, _divisors(c.tp)))}), "
                        f"got {c.dcp}")
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
    v_head_dim: int = 256
    num_layers: int = 78  # MLA layers of the model (GLM-5's decoder layers; an MTP draft's is one more)
    project_before_merge: bool = True  # the projection through W_UV before the DCP merge (each build's switch)
    projection_source: str = ""  # how it was set, for the text ("server.args --dcp-v-up-proj-before-merge on")
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
    def projects_before_merge(self) -> bool:
        """Whether the layers project through ``W_UV_dcp`` before the merge: the switch on and DCP > 1."""
        return self.project_before_merge and self.dcp > 1

    @property
    def a2a_head_dim(self) -> int:
        """The head dimension the DCP combine, and so the A2A workspace's output, is sized for."""
        return self.v_head_dim if self.projects_before_merge else self.kv_lora_rank

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
class Plan:
    """What a serving configuration allocates per GPU for DCP: the two workspaces and ``W_UV_dcp``."""

    config: ServingConfig
    tokens: int  # the workspaces' capacity; steps above it take the NCCL fallback
    q_gather_bytes: int
    a2a_bytes: int
    w_uv_dcp_layer_bytes: int

    @property
    def w_uv_dcp_bytes(self) -> int:
        return self.w_uv_dcp_layer_bytes * self.config.num_layers

    @property
    def total_bytes(self) -> int:
        return self.q_gather_bytes + self.a2a_bytes + self.w_uv_dcp_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "tokens": self.tokens,
                "project_before_merge": self.config.projects_before_merge,
                "a2a_head_dim": self.config.a2a_head_dim,
                "q_gather_bytes": self.q_gather_bytes, "a2a_bytes": self.a2a_bytes,
                "w_uv_dcp": {"layer_bytes": self.w_uv_dcp_layer_bytes, "num_layers": self.config.num_layers,
                             "bytes": self.w_uv_dcp_bytes},
                "total_bytes": self.total_bytes}


def plan(config: ServingConfig) -> Plan:
    """Capacity and per-GPU bytes of both workspaces and of the gathered ``W_UV`` (none at DCP 1)."""
    c = config
    tokens = capacity_tokens(c.max_num_seqs, c.max_num_batched_tokens, c.speculative_tokens,
                             c.parallel_drafting, c.effective_cudagraph_capture_size)
    if c.dcp == 1:  # no MLADCPManager: neither workspace is allocated
        return Plan(c, tokens, 0, 0, 0)
    return Plan(
        c, tokens,
        q_gather_bytes=q_gather_workspace_bytes(tokens, c.dcp, c.heads_per_rank, c.kv_lora_rank + c.qk_rope_head_dim,
                                                c.query_dtype_bytes, c.num_ubatches, c.q_padded_heads),
        a2a_bytes=a2a_workspace_bytes(tokens, c.dcp, c.heads_per_rank, c.a2a_head_dim, c.output_dtype_bytes,
                                      c.num_ubatches),
        w_uv_dcp_layer_bytes=(w_uv_dcp_layer_bytes(c.dcp, c.heads_per_rank, c.kv_lora_rank, c.v_head_dim,
                                                   c.output_dtype_bytes) if c.projects_before_merge else 0),
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:9.1f} MB ({n / 2**20:7.1f} MiB)"


def _said(c: ServingConfig) -> str:
    """How the projection was set, for a line of the plan ("" when the config does not say)."""
    return f" ({c.projection_source})" if c.projection_source else ""


def _w_uv_line(p: Plan) -> str:
    c = p.config
    if c.dcp == 1:
        return "W_UV_dcp: none (DCP 1: no merge to project before)"
    if not c.project_before_merge:
        return f"W_UV_dcp: none (projection off: the merge exchanges kv_lora_rank {c.kv_lora_rank}, no W_UV gathered)"
    return (f"W_UV_dcp: {p.w_uv_dcp_layer_bytes / 2**20:.1f} MiB per layer x {c.num_layers} layers = "
            f"{p.w_uv_dcp_bytes / 2**30:.2f} GiB per GPU ({p.w_uv_dcp_bytes / 2**20:.1f} MiB), "
            "counted in the model's weight memory "
            f"(gathered while loading, before vLLM sizes the KV cache)")


def format_plan(p: Plan) -> str:
    """A short human-readable table."""
    c = p.config
    spec = (f"{c.speculative_tokens} speculative tokens"
            + (" (parallel drafting)" if c.parallel_drafting else "")) if c.speculative_tokens else "no speculation"
    q_heads = c.q_padded_heads or c.dcp * c.heads_per_rank
    projection = ("off at DCP 1" if c.dcp == 1 else
                  f"on{_said(c)}: the A2A output holds v_head_dim {c.v_head_dim} per head"
                  if c.project_before_merge else
                  f"off{_said(c)}: the A2A output holds kv_lora_rank {c.kv_lora_rank} per head")
    lines = [
        f"TP {c.tp}, DCP {c.dcp}, {c.num_heads} heads ({c.heads_per_rank} per TP rank), "
        f"kv_lora_rank {c.kv_lora_rank}, v_head_dim {c.v_head_dim}, rope {c.qk_rope_head_dim}, "
        f"{c.num_layers} MLA layers",
        f"max_num_seqs {c.max_num_seqs}, {spec} -> {tokens_per_seq(c.speculative_tokens, c.parallel_drafting)}"
        f" tokens/seq; max_num_batched_tokens {c.max_num_batched_tokens}; "
        f"cudagraph capture {c.effective_cudagraph_capture_size}"
        f"{'' if c.cudagraph_capture_size is not None else ' (vLLM default)'}; ubatches {c.num_ubatches}",
        f"projection before the DCP merge: {projection}",
        "no DCP manager at DCP 1: no workspace, no W_UV_dcp" if c.dcp == 1 else
        f"q-gather: {q_heads} query heads x {c.kv_lora_rank + c.qk_rope_head_dim} x {c.query_dtype_bytes} B; "
        f"A2A: {c.dcp} ranks x 2 buffers x {c.heads_per_rank} heads x {c.a2a_head_dim} x "
        f"{c.output_dtype_bytes} B (+ fp32 LSE)",
        "",
        f"capacity: {p.tokens} tokens per step (decode formula); "
        + ("unused at DCP 1" if c.dcp == 1 else "steps above it take the NCCL fallback"),
        "",
        "per GPU",
        f"{'q-gather workspace':<24} {_mb(p.q_gather_bytes)}",
        f"{'A2A workspace':<24} {_mb(p.a2a_bytes)}",
        f"{'W_UV_dcp':<24} {_mb(p.w_uv_dcp_bytes)}",
        f"{'total':<24} {_mb(p.total_bytes)}",
        "",
        _w_uv_line(p),
    ]
    return "\n".join(lines) + "\n"


def _env_bool(env: dict[str, str], name: str, where: str, meaning: str) -> bool | None:
    """A variable of a profile's server environment as vLLM reads it, ``bool(int(value))`` (None: unset)."""
    raw = env.get(name)
    if raw is None:
        return None
    try:
        return bool(int(raw))
    except ValueError:
        raise ValueError(f"{where}: server.env.{name} must be an integer ({meaning}; vLLM reads "
                         f"bool(int(value))), got {raw!r}") from None


def auto_projects(backend: str | None, direct: bool | None) -> tuple[bool, str]:
    """Whether our 0.34.0 series projects before the merge under ``--dcp-v-up-proj-before-merge auto``, and why.

    ``auto`` is upstream's policy (``dcp-v-up-proj-before-merge-config.patch``): ``MLADCPManager`` registers a
    projected combine over the NCCL All-to-All only; over ag_rs, and over the direct symmetric-memory A2A that
    ``--dcp-comm-backend a2a`` takes where ``VLLM_USE_DIRECT_DCP_A2A`` is 1, or unset on one node with
    symmetric memory (what this plan sizes its A2A workspace for), it merges the latent output and gathers no
    ``W_UV``. ``backend`` None: GLM-5's default (:data:`AUTO_DEFAULT_BACKEND`).
    """
    named = backend is not None
    backend = backend or AUTO_DEFAULT_BACKEND
    said = f"{COMM_BACKEND_ARG} {backend}" if named else f"{backend}, GLM-5's default on 0.34.0"
    if backend == "ag_rs":
        return False, f"{said}: auto projects over the NCCL a2a only"
    if direct is False:
        return True, f"{said} over NCCL ({DIRECT_A2A_ENV}=0): auto projects there"
    how = f"{DIRECT_A2A_ENV}=1" if direct else f"{DIRECT_A2A_ENV} unset: direct on one node"
    return False, f"{said} over the direct A2A ({how}): auto projects over the NCCL a2a only"


def _projection(server: ServerSpec, where: str) -> tuple[bool, str] | None:
    """(on, how the profile says it) from its server arguments (our 0.34.0 series' engine argument, ``auto``
    resolved for its transport) or its environment (0.28.0's variable); None when it sets neither.
    ValueError, one line naming the field: both set, or a value the build would refuse."""
    value = server.arg_value(PROJECT_ARG)
    if value is None and PROJECT_ARG in server.args:
        raise ValueError(f"{where}: server.args: {PROJECT_ARG} is the last argument, without its value "
                         f"({', '.join(PROJECT_VALUES)})")
    env = _env_bool(server.env, PROJECTION_ENV, where, "0 off, 1 on")
    if value is not None and PROJECTION_ENV in server.env:
        raise ValueError(f"{where}: server.args {PROJECT_ARG} {shown(value)} and server.env.{PROJECTION_ENV} both set "
                         "the projection, and a build reads only one (our 0.34.0 series the argument, 0.28.0's "
                         "the variable): keep the one of the build this profile runs")
    if value is None:
        return None if env is None else (env, f"server.env {PROJECTION_ENV}={server.env[PROJECTION_ENV]}")
    if value not in PROJECT_VALUES:
        raise ValueError(f"{where}: server.args: {PROJECT_ARG} {shown(value)}: expected "
                         f"{', '.join(PROJECT_VALUES)}")
    said = f"server.args {PROJECT_ARG} {value}"
    if value != "auto":
        return value == "on", said
    backend = server.arg_value(COMM_BACKEND_ARG)
    if backend is not None and backend not in COMM_BACKENDS:
        raise ValueError(f"{where}: server.args: {COMM_BACKEND_ARG} {shown(backend)}: expected "
                         f"{' or '.join(COMM_BACKENDS)}")
    on, why = auto_projects(backend, _env_bool(server.env, DIRECT_A2A_ENV, where, "0 NCCL, 1 direct"))
    return on, f"{said}, {why}"


def config_from_profile(name_or_path: str) -> dict[str, Any]:
    """The sizing parameters a regress profile's ``vllm serve`` arguments and environment set (others absent)."""
    from overlay.regress.profiles import load_profile

    server = load_profile(name_or_path).server
    try:
        found = _server_args(server)
    except ValueError as exc:
        raise ValueError(f"--profile {name_or_path}: server.args: {one_line(str(exc))}") from None
    projection = _projection(server, name_or_path)
    if projection is None:
        found["projection_source"] = (f"the profile sets neither {PROJECT_ARG} nor {PROJECTION_ENV}: on, as "
                                      "0.28.0's series by default; 0.34.0's series takes auto")
    else:
        found["project_before_merge"], found["projection_source"] = projection
    return found


def _server_args(server: ServerSpec) -> dict[str, Any]:
    """The sizing parameters of the server's arguments; ValueError naming the flag of one that is not a number."""
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
                try:
                    found[key] = int(value)
                except ValueError:
                    raise ValueError(f"{flag} {shown(value)}: not an integer") from None
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
    project = overrides.get("project_before_merge")
    if overrides.get("projection_source") is None:  # the text names what decided: the flag, the profile, the default
        if isinstance(project, bool):
            values["projection_source"] = "--project-before-merge" if project else "--no-project-before-merge"
        else:
            values.setdefault("projection_source", "the default; --no-project-before-merge for off")
    return replace(ServingConfig(), **values)
