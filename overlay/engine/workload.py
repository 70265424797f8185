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

Which cases a build runs is decided by its release's facts (:class:`overlay.releases.facts.ReleaseFacts`,
read from the tree the engines import), never by its version: a release whose GLM-5 config chooses the
DCP options a user leaves unset (0.33.0 and 0.34.0: a2a with query replication) gets cases of its own
(:func:`release_cases`): TP2 x DCP2 with nothing set, with our profiles' explicit settings (which leave
query replication to it) and with the query all-gather named explicitly, each judged against its DCP 1
reference and on what the engine resolved (``Case.resolves``); a release that defaults to Model Runner
V2 and still has V1 (0.33.0) runs its DCP 1 references under both (:func:`runner_cases`).

A case asks the projection through ``W_UV`` before the DCP merge ``on`` or ``off`` (``Case.projection``, or
leaves it to the build), never by a variable: ``run_case`` spells it the way the build under test reads it
(:mod:`overlay.releases.projection`).

Each case also names the patches that must act in it (``Case.acts``, from the release's own
``patches/<release>/engine.toml``): under ``engine-check --coverage`` a named patch none of whose added
statements ran fails the case (:func:`overlay.releases.engine_cases.declared_acts`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from overlay.releases.engine_cases import V1_RUNNER_ENV, declared_acts, record_projection

if TYPE_CHECKING:
    from overlay.releases.facts import ReleaseFacts

PROMPT_LENS = (100, 3000, 9000, 8, 16, 24, 40)
# The long cases: one prompt of about 60,000 tokens, then DECODE_STEPS decode steps (upstream
# #46145: a hang at the first decode after a ~131K-token prefill with FULL graphs and DCP > 1).
LONG_PROMPT_LENS = (60000,)
# The prompt sweep (upstream #54300: after a release bump, prompts over about 128 tokens came back as
# random tokens under DCP while short ones were right): one request per length, around the 128 edge
# and up to index_topk (2,048; under DCP shorter prefills go to dense MHA since vLLM 0.29.0), whose
# decodes then pass index_topk, so the indexer's top-k merge across the DCP ranks runs.
SWEEP_PROMPT_LENS = (128, 129, 256, 512, 1024, 2047, 2048)
# What vLLM logs once when it builds the direct symmetric-memory exchange of the DCP top-k candidates
# (0.34.0: get_direct_dcp_topk_workspace in vllm/model_executor/kernels/attention/dsa/dcp_topk_direct.py,
# switched by VLLM_USE_DIRECT_DCP_A2A; ReleaseFacts.direct_a2a_switches names that module).
DIRECT_TOPK_LOG = "direct DCP top-k candidate exchange"
DIRECT_TOPK_MODULE = "dcp_topk_direct"
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
# What a release makes of the DCP options a GLM-5 user leaves unset, and its default model runner, are
# release facts (overlay/releases/: ReleaseFacts.dcp_*, .runner, .v1_runner), read from its tree.
# A build on Model Runner V2 that still has V1 runs the DCP 1 references again under V1
# (V1_RUNNER_ENV), where spec-decode-prompt-logprobs-graph-pool still applies.
# The explicit settings of our two-GPU regress profiles (overlay/regress/profiles/): their
# server arguments name the comm backend, never query replication; their env names the rest, the
# projection before the DCP merge as "on" / "off" (each build spells it its own way: Case.projection).
PROFILE_SETTINGS: dict[str, dict[str, Any]] = {
    "tiny-glm5-tp2-dcp2-mtp5": {"backend": "a2a", "env": {"VLLM_USE_DIRECT_DCP_A2A": "1"}, "projection": "on"},
    "tiny-glm5-tp2-dcp2-agrs-mtp5": {"backend": "ag_rs", "env": {}, "projection": "on"},
}
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
    backend: str = "ag_rs"  # dcp_comm_backend; "" passes none (the release's default decides)
    eager: bool = False
    mtp: bool = False
    env: dict[str, str] = field(default_factory=dict)
    # the projection through W_UV before the DCP merge: "on" / "off", "" leaves it to the build. Release-neutral:
    # run_case spells it as the build under test reads it (overlay.releases.projection: 0.34.0's series the engine
    # argument, 0.28.0's the variable) and fails the case in one line on a build that cannot take it
    projection: str = ""
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
    q_replicate: bool | None = None  # dcp_q_replicate (vLLM 0.33.0's option); None passes none
    # what the engine's config must have resolved to (``run_case`` records ``resolved``): e.g.
    # {"dcp_comm_backend": "a2a", "dcp_q_replicate": True}; {} not judged
    resolves: dict[str, Any] = field(default_factory=dict)
    release: str = ""  # the release whose build the case is written for ("": any)
    # what its engine's log must show (each a substring of one line), e.g. that a direct exchange was built
    log_lines: tuple[str, ...] = ()
    # the patches (file names in the release's series) that must act here: engine-check --coverage fails the
    # case when one ran none of its added statements (:func:`declared_acts`). Not an engine setting, so neither in
    # to_dict nor compared: run_case and --reuse see the case as before.
    acts: tuple[str, ...] = field(default=(), compare=False)

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
            if self.backend:
                kw["dcp_comm_backend"] = self.backend
            if self.q_replicate is not None:
                kw["dcp_q_replicate"] = self.q_replicate
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
                "eager": self.eager, "mtp": self.mtp, "env": dict(self.env),
                **({"projection": self.projection} if self.projection else {}), "reverse": self.reverse,
                "max_num_batched_tokens": self.max_num_batched_tokens, "note": self.note,
                **({"compare_to": self.compare_to} if self.compare_to else {}),
                **({"interleave": self.interleave} if self.interleave > 1 else {}),
                **({"graphs": self.graphs} if self.graphs else {}),
                **({"prompt_lens": list(self.prompt_lens)} if tuple(self.prompt_lens) != PROMPT_LENS else {}),
                **({"q_replicate": self.q_replicate} if self.q_replicate is not None else {}),
                **({"resolves": dict(self.resolves)} if self.resolves else {}),
                **({"release": self.release} if self.release else {}),
                **({"log_lines": list(self.log_lines)} if self.log_lines else {})}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Case:
        """The case :meth:`to_dict` wrote (the case file ``run_case`` reads); one written before cases had
        ``projection`` carries it as ``env`` ``VLLM_DCP_PROJECT_BEFORE_MERGE`` 1 / 0, read as ``on`` / ``off``
        (:func:`overlay.releases.engine_cases.record_projection`)."""
        projection, env = record_projection(doc)
        return cls(**{k: tuple(v) if k in ("prompt_lens", "log_lines") else v for k, v in doc.items()
                      if k not in ("env", "projection")}, env=env, projection=projection)


def _dcp(name: str, *, backend: str = "a2a", direct: bool = True, project: bool = True, eager: bool = False,
         mtp: bool = False, fused: bool = False, tp: int = 2, dcp: int = 2, interleave: int = 1,
         long: bool = False) -> Case:
    env: dict[str, str] = {}
    if backend == "a2a":
        env["VLLM_USE_DIRECT_DCP_A2A"] = "1" if direct else "0"
    if fused:  # dcp-project-before-merge-fused's opt-in Triton kernels
        env["VLLM_DCP_PROJECT_FUSED"] = "1"
    # MTP under DCP: (1 + k)-token steps are decodes in FULL graphs with interleave 1, prefills
    # (spec decoding piecewise) with interleave > 1 (flashmla-sparse-dcp-spec-cudagraphs)
    graphs = "" if eager or not mtp else ("FULL" if interleave == 1 else "PIECEWISE")
    ref = ("ref-dcp1-mtp-long" if long else "ref-dcp1-mtp") if mtp else ""
    return Case(name, tp=tp, dcp=dcp, backend=backend, eager=eager, mtp=mtp, env=env,
                projection="on" if project else "off", compare_to=ref,
                interleave=interleave, graphs=graphs, prompt_lens=LONG_PROMPT_LENS if long else PROMPT_LENS)


def cases(tp: int = 2, facts: ReleaseFacts | None = None) -> list[Case]:
    """Every case for TP ``tp`` (DCP = TP), references first, then by value, for the build whose release
    ``facts`` describe (None: the generic cases, the default release's ``engine.toml``). A release whose GLM-5 config
    chooses the DCP defaults runs :func:`release_cases` first after the references, then the others, each
    judged on what it resolved there too; one on Model Runner V2 that still has V1 adds
    :func:`runner_cases`. Each names the patches that must act in it (:func:`declared_acts`).

    With ``tp == 1`` only the DCP 1 cases remain (a one-GPU machine cannot run DCP).
    """
    release = facts.release if facts is not None else None
    return [replace(c, acts=declared_acts(c, release)) for c in _ordered(tp, facts)]


def _ordered(tp: int, facts: ReleaseFacts | None) -> list[Case]:
    generic = _cases(tp)
    runners = runner_cases(facts, tp)
    if runners:
        assert facts is not None
        # the release's default runner is what the references run: say so (``Case.resolves``)
        generic = [replace(c, release=facts.release, resolves={**c.resolves, "use_v2_model_runner": True})
                   if c.name == "ref-dcp1-mtp" else c for c in generic]
    own = release_cases(facts, tp)
    if not own and not runners:
        return [*generic, *sweep_cases(facts, tp)]
    if not own:
        # one GPU: the references, then the V1-runner cases, then the rest
        return [*generic[:1], *(c for c in generic if c.name == "ref-dcp1-mtp"), *runners,
                *(c for c in generic[1:] if c.name != "ref-dcp1-mtp")]
    assert facts is not None
    # the generic cases on this build: the comm backend each names, query replication as the release
    # resolves it for GLM-5 (none of them names it)
    generic = [replace(c, release=facts.release, resolves={**c.resolves, "dcp_comm_backend": c.backend,
                                                           "dcp_q_replicate": facts.dcp_q_replicate})
               if c.dcp > 1 and c.q_replicate is None and not c.resolves else c for c in generic]
    by_name = {c.name: c for c in generic}
    first = [by_name[n] for n in ("ref-dcp1", "ref-dcp1-mtp")]
    spread, profile = by_name["ref-dcp1-reordered"], by_name["dcp-a2a-direct-proj1-graph-mtp"]
    rest = [c for c in generic if c.name not in {*(f.name for f in first), spread.name, profile.name}]
    # the references, the release's defaults, a spread run, our profile's production shape, the V1-runner
    # cases, then the rest, the prompt sweep last
    return [*first, own[0], spread, profile, *runners, *own[1:], *rest, *sweep_cases(facts, tp)]


def sweep_cases(facts: ReleaseFacts | None, tp: int = 2) -> list[Case]:
    """The prompt sweep (:data:`SWEEP_PROMPT_LENS`, 128 to 2,048 tokens, MTP-5 in FULL decode graphs) at
    TP ``tp`` x DCP ``tp``, each against its DCP 1 run (``ref-dcp1-mtp-sweep``): with our profiles'
    explicit settings, and where the release's GLM-5 config chooses the DCP options a user leaves unset,
    with nothing set (``dcp-defaults-graph-mtp-sweep``). Where the release has the direct top-k exchange
    (``ReleaseFacts.direct_a2a_switches``) and it is not off by default, the defaults case and the direct
    a2a profile's must log that it was built (:data:`DIRECT_TOPK_LOG`). None below two GPUs.
    """
    if tp < 2:
        return []
    release = facts.release if facts is not None else ""
    d = {"tp": tp, "dcp": tp, "mtp": True, "graphs": "FULL", "prompt_lens": SWEEP_PROMPT_LENS,
         "compare_to": "ref-dcp1-mtp-sweep", "release": release}
    topk = facts is not None and facts.direct_a2a_default is not False and any(
        m.rsplit(".", 1)[-1] == DIRECT_TOPK_MODULE for m in facts.direct_a2a_switches)
    direct_log = (DIRECT_TOPK_LOG,) if topk else ()
    a2a, agrs = PROFILE_SETTINGS["tiny-glm5-tp2-dcp2-mtp5"], PROFILE_SETTINGS["tiny-glm5-tp2-dcp2-agrs-mtp5"]
    by_model = facts is not None and facts.dcp_defaults_by_model

    def resolves(backend: str) -> dict[str, Any]:  # where GLM-5's config decides what the case leaves unset
        assert facts is not None
        return {"dcp_comm_backend": backend or facts.dcp_comm_backend, "dcp_q_replicate": facts.dcp_q_replicate}

    out = [Case("ref-dcp1-mtp-sweep", role="reference", tp=tp, mtp=True, graphs="FULL",
                prompt_lens=SWEEP_PROMPT_LENS, release=release,
                note="prompts of 128 to 2,048 tokens, MTP-5 at DCP 1: the sweep's reference")]
    if by_model:
        out.append(Case("dcp-defaults-graph-mtp-sweep", backend="", log_lines=direct_log, resolves=resolves(""),
                        note=f"the sweep under vLLM {release}'s GLM-5 defaults (no DCP option set)", **d))
    out += [
        Case("dcp-a2a-direct-proj1-graph-mtp-sweep", backend=a2a["backend"], env=dict(a2a["env"]),
             projection=a2a["projection"],
             log_lines=direct_log, resolves=resolves(a2a["backend"]) if by_model else {},
             note="the sweep with profile tiny-glm5-tp2-dcp2-mtp5's settings", **d),
        Case("dcp-agrs-proj1-graph-mtp-sweep", backend=agrs["backend"], env=dict(agrs["env"]),
             projection=agrs["projection"],
             resolves=resolves(agrs["backend"]) if by_model else {},
             note="the sweep with profile tiny-glm5-tp2-dcp2-agrs-mtp5's settings", **d),
    ]
    return out


def runner_cases(facts: ReleaseFacts | None, tp: int = 2) -> list[Case]:
    """DCP 1 under the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``) on a build whose release defaults to
    Model Runner V2 and still has V1 (``ReleaseFacts.runs_v1_by_choice``; none otherwise), each judged on
    having run V1:

    - ``ref-dcp1-v1``, a second reference, judged against ``ref-dcp1`` (V2): the two runners must agree;
    - ``ref-dcp1-mtp-v1``, MTP-5 in FULL decode graphs, judged against ``ref-dcp1-v1`` (the plain run of
      the same runner): prompt logprobs come from the target alone, which
      spec-decode-prompt-logprobs-graph-pool restores in the V1 runner; against the same runner's
      plain run, a runner's own fault does not hide the patch's effect (one H200, 2026-12-02: 0.33.0's
      V1 runner moved the batch's first request with its breakable CUDA graphs, MTP or not).
    """
    if facts is None or not facts.runs_v1_by_choice:
        return []
    v1, release = {"use_v2_model_runner": False}, facts.release
    return [
        Case("ref-dcp1-v1", role="reference", tp=tp, env=dict(V1_RUNNER_ENV), resolves=v1, release=release,
             note="DCP 1 under the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0), judged against Model Runner "
                  "V2's ref-dcp1"),
        Case("ref-dcp1-mtp-v1", tp=tp, mtp=True, graphs="FULL", env=dict(V1_RUNNER_ENV), resolves=v1,
             compare_to="ref-dcp1-v1", release=release,
             note="MTP-5 at DCP 1 under the V1 model runner, FULL decode graphs: prompt logprobs judged against "
                  "ref-dcp1-v1"),
    ]


def release_cases(facts: ReleaseFacts | None, tp: int = 2) -> list[Case]:
    """The two-GPU cases of a build whose release lets GLM-5's config choose the DCP options a user leaves
    unset (``ReleaseFacts.dcp_defaults_by_model``; none otherwise, or without DCP): TP ``tp`` x DCP ``tp`` with

    - nothing set (``dcp-defaults-*``): the release's GLM-5 defaults (0.33.0: a2a with query
      replication; the direct a2a and project-before-merge by their own defaults), with MTP-5 in
      FULL decode graphs, without MTP, with project-before-merge off (the release's own merge
      under replication), with it on (its default is off on a release no DCP > 1 engine run has shown it);
    - our profiles' explicit settings (``PROFILE_SETTINGS``), which leave query replication to the
      release (``dcp-a2a-direct-proj1-graph-mtp``, ``dcp-agrs-proj1-graph-mtp``: the generic cases);
    - those settings with the query all-gather named (``dcp_q_replicate=False``): the decode path of
      0.28.0, on this build.

    Each is judged against its DCP 1 reference (``ref-dcp1-mtp``, or ``ref-dcp1`` without MTP) and
    on the settings it resolved to (``Case.resolves``).
    """
    if facts is None or not facts.dcp_defaults_by_model or tp < 2:
        return []
    release, d = facts.release, {"tp": tp, "dcp": tp}

    def own(name: str, *, mtp: bool = True, backend: str = "", env: dict[str, str] | None = None,
            projection: str = "", q_replicate: bool | None = None, note: str) -> Case:
        resolves = {"dcp_comm_backend": backend or facts.dcp_comm_backend,
                    "dcp_q_replicate": facts.dcp_q_replicate if q_replicate is None else q_replicate}
        return Case(name, backend=backend, mtp=mtp, env=dict(env or {}), projection=projection,
                    q_replicate=q_replicate, resolves=resolves,
                    release=release, compare_to="ref-dcp1-mtp" if mtp else "", graphs="FULL" if mtp else "",
                    note=note, **d)

    a2a, agrs = PROFILE_SETTINGS["tiny-glm5-tp2-dcp2-mtp5"], PROFILE_SETTINGS["tiny-glm5-tp2-dcp2-agrs-mtp5"]
    return [
        own("dcp-defaults-graph-mtp", note=f"vLLM {release}'s GLM-5 defaults (no DCP option set), MTP-5"),
        own("dcp-a2a-direct-proj1-qgather-graph-mtp", backend=a2a["backend"], env=a2a["env"],
            projection=a2a["projection"], q_replicate=False,
            note="profile tiny-glm5-tp2-dcp2-mtp5's settings with the query all-gather (0.28.0's decode path)"),
        own("dcp-defaults-graph", mtp=False, note=f"vLLM {release}'s GLM-5 defaults, no MTP"),
        own("dcp-defaults-proj0-graph-mtp", projection="off",
            note="the defaults, project-before-merge off: the release's own merge under query replication"),
        own("dcp-agrs-proj1-qgather-graph-mtp", backend=agrs["backend"], env=agrs["env"],
            projection=agrs["projection"], q_replicate=False,
            note="profile tiny-glm5-tp2-dcp2-agrs-mtp5's settings with the query all-gather (0.28.0's default)"),
        own("dcp-defaults-proj1-graph-mtp", projection="on",
            note="the defaults, project-before-merge on: the projection on GLM-5's own attention"),
    ]


def _cases(tp: int) -> list[Case]:
    """The cases of the default pin's build (every release runs them too)."""
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
        _dcp("dcp-a2a-direct-fused-graph-mtp", fused=True, mtp=True, **d),
        _dcp("dcp-agrs-fused-graph", backend="ag_rs", fused=True, **d),
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
