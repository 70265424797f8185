"""Regression profiles: validated YAML naming the server, the checks, thresholds and baselines.

A profile is found by name among the shipped ones (``overlay/regress/profiles/<name>.yaml``) or
by path. Loading collects every problem before raising one :class:`ProfileError` whose text
names the file and each field at fault. Every threshold carries a ``why``: a number nobody can
justify is not a threshold.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from overlay import numbers, textfile
from overlay.errors import shown_value
from overlay.regress import yamltext
from overlay.regress.checks import DEFAULTS, HIGH, NAMES, THRESHOLDS
from overlay.regress.errors import ProfileError
from overlay.regress.fields import Fields

LATENCY_TOOLS = ("vllm-bench", "builtin")
GSM8K_METRICS = ("strict-match", "flexible-extract")  # lm-eval's two GSM8K filters, each with a baseline
# The checks, their order, the thresholds each reads and each threshold's range: overlay.regress.checks
# (NAMES, DEFAULTS, THRESHOLDS, HIGH).
MAX_PORT = 65535


@dataclass(frozen=True)
class Threshold:
    value: float
    why: str


@dataclass(frozen=True)
class ServerSpec:
    model: str
    served_model_name: str
    args: tuple[str, ...]
    env: dict[str, str]
    host: str
    port: int
    ready_timeout_s: float
    vllm_bin: str
    attach_timeout_s: float = 30.0  # attached (BASE_URL): how long connections may be refused

    @property
    def vllm_argv(self) -> list[str]:
        """``vllm_bin`` as argv: it may be a command line ("python3 -m vllm.entrypoints.cli.main"
        where vLLM is only on PYTHONPATH)."""
        return shlex.split(self.vllm_bin)

    @property
    def model_path(self) -> str:
        """``model`` with a leading ``~`` expanded (a local checkpoint); hub names unchanged."""
        return os.path.expanduser(self.model) if self.model.startswith("~") else self.model

    def command(self) -> list[str]:
        cmd = [*self.vllm_argv, "serve", self.model_path, "--host", self.host, "--port", str(self.port)]
        if self.served_model_name != self.model:
            cmd += ["--served-model-name", self.served_model_name]
        return cmd + list(self.args)

    def arg_value(self, flag: str) -> str | None:
        """The value given to ``flag`` in the server args (``--flag v`` or ``--flag=v``)."""
        for i, arg in enumerate(self.args):
            if arg == flag and i + 1 < len(self.args):
                return self.args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
        return None

    @property
    def speculative_config(self) -> dict[str, Any] | None:
        """The JSON object given to ``--speculative-config``, or None without the flag."""
        raw = self.arg_value("--speculative-config")
        if raw is None:
            return None
        try:
            spec = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"--speculative-config: not JSON ({exc})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"--speculative-config: expected a JSON object, got {shown_value(raw)}")
        return spec

    @property
    def speculative_tokens(self) -> int:
        """``num_speculative_tokens`` of ``--speculative-config`` (0 without); ValueError unless an integer >= 0."""
        value = (self.speculative_config or {}).get("num_speculative_tokens", 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"--speculative-config num_speculative_tokens: must be an integer >= 0, "
                             f"got {shown_value(value)}")
        return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


@dataclass(frozen=True)
class Gsm8kSpec:
    num_fewshot: int
    max_gen_toks: int
    concurrency: int
    limit: int | None
    timeout_s: float
    data: str | None


@dataclass(frozen=True)
class LongContextSpec:
    index_topk: int
    workspace_capacity_tokens: int
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    count_to: int
    repeats: int
    request_timeout_s: float
    extra_body: dict[str, Any]


@dataclass(frozen=True)
class DifferentialSpec:
    """The differential check's prompts (seeded random token ids) and decoding (``regress.differential``)."""

    prompt_tokens: tuple[int, ...] = (100, 3000, 9000, 8, 16, 24, 40)
    token_range: tuple[int, int] = (0, 256)
    seed: int = 0
    max_tokens: int = 64
    top_logprobs: int = 5
    index_topk: int = 2048
    spread_runs: int = 1
    request_timeout_s: float = 900.0


@dataclass(frozen=True)
class LatencySpec:
    tool: str
    input_len: int
    output_len: int
    num_prompts: int
    timeout_s: float


@dataclass(frozen=True)
class Baseline:
    source: str
    gsm8k: dict[str, float]
    gsm8k_stderr: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    acceptance_per_position: tuple[float, ...] | None
    latency_tool: str = "vllm-bench"  # the tool that measured mean_ttft_ms / mean_tpot_ms


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    path: str
    checks: tuple[str, ...]
    server: ServerSpec
    gsm8k: Gsm8kSpec
    long_context: LongContextSpec
    latency: LatencySpec
    baseline: Baseline
    thresholds: dict[str, Threshold] = field(default_factory=dict)
    differential: DifferentialSpec = field(default_factory=DifferentialSpec)
    checks_off: dict[str, str] = field(default_factory=dict)  # check -> why it is off for this profile

    def threshold(self, name: str) -> float:
        return self.thresholds[name].value

    def with_overrides(self, *, gsm8k_data: str | None = None, gsm8k_limit: int | None = None,
                       latency_tool: str | None = None, ready_timeout_s: float | None = None,
                       attach_timeout_s: float | None = None, skip: tuple[str, ...] = (),
                       port: int | None = None, vllm_bin: str | None = None) -> Profile:
        """A copy with the run-time options of the CLI applied (each validated like the YAML)."""
        unknown = [c for c in skip if c not in NAMES]
        if unknown:
            raise ProfileError(f"--skip: unknown check(s) {', '.join(unknown)} (known: {', '.join(NAMES)})")
        if latency_tool is not None and latency_tool not in LATENCY_TOOLS:
            raise ProfileError(f"--latency-tool: {latency_tool!r} is not one of {', '.join(LATENCY_TOOLS)}")
        checks = tuple(c for c in self.checks if c not in skip)
        if latency_tool is not None and "latency" in checks and latency_tool != self.baseline.latency_tool:
            raise ProfileError(f"--latency-tool {latency_tool}: the baseline in {self.path} (baseline.latency.tool) "
                               f"was measured with {self.baseline.latency_tool}, and the two tools do not measure "
                               f"the same thing; use a baseline measured with {latency_tool}, or --skip latency")
        wrong = numbers.problem(attach_timeout_s, 0, strict=True) if attach_timeout_s is not None else None
        if wrong:  # the command line checks both where it reads them; this holds for any other caller
            raise ProfileError(f"attach timeout (--attach-timeout, REGRESS_ATTACH_TIMEOUT): {wrong}")
        if port is not None and not 0 < port <= MAX_PORT:
            raise ProfileError(f"--port: expected 1-{MAX_PORT}, got {port}")
        if vllm_bin is not None and not vllm_bin.split():
            raise ProfileError("--vllm-bin: empty command")
        if gsm8k_data is not None:
            check_gsm8k_data(Path(gsm8k_data), "--gsm8k-data")
        gsm8k = replace(self.gsm8k, data=gsm8k_data or self.gsm8k.data,
                        limit=gsm8k_limit if gsm8k_limit is not None else self.gsm8k.limit)
        latency = replace(self.latency, tool=latency_tool or self.latency.tool)
        server = replace(self.server, ready_timeout_s=ready_timeout_s or self.server.ready_timeout_s,
                         attach_timeout_s=attach_timeout_s or self.server.attach_timeout_s,
                         port=port or self.server.port, vllm_bin=vllm_bin or self.server.vllm_bin)
        return replace(self, gsm8k=gsm8k, latency=latency, server=server, checks=checks)


def shipped_profiles() -> list[str]:
    folder = resources.files("overlay.regress") / "profiles"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str) -> Profile:
    """Load a shipped profile by name, or a profile file by path; raise :class:`ProfileError`."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ProfileError(f"{path}: no such profile file")
        return parse_profile(yamltext.read(path), str(path))
    shipped = resources.files("overlay.regress") / "profiles" / f"{name_or_path}.yaml"
    if not shipped.is_file():
        raise ProfileError(f"no profile {name_or_path!r} (shipped: {', '.join(shipped_profiles())})")
    return parse_profile(shipped.read_text(encoding="utf-8"), f"overlay/regress/profiles/{name_or_path}.yaml")


def check_gsm8k_data(folder: Path, where: str) -> None:
    """Raise :class:`ProfileError` unless ``folder`` holds GSM8K's ``train.jsonl`` and ``test.jsonl``."""
    missing = [s for s in ("train.jsonl", "test.jsonl") if not (folder / s).is_file()]
    if missing:
        raise ProfileError(f"{where}: {folder} lacks {' and '.join(missing)} (GSM8K-format JSON lines)")


def parse_profile(text: str, source: str) -> Profile:
    """Parse and validate a profile's YAML text; ``source`` names it in every error."""
    textfile.refuse_empty(text, source, ProfileError, "a profile (name, server, checks, ...)")
    data = yamltext.loads(text, source)
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a mapping at the top level")
    problems: list[str] = []
    f = Fields(problems)
    name, description, checks, checks_off = _top_level(f, data)
    server, spec_tokens = _server(f, data)
    gsm8k = _gsm8k(f, data)
    long_context = _long_context(f, data)
    differential = _differential(f, data, checks)
    latency = _latency(f, data)
    baseline = _baseline(f, data, checks, spec_tokens, latency)
    thresholds = _thresholds(f, data, checks)
    problems += f.unknown_keys()

    if problems:
        raise ProfileError(f"{source}: " + "; ".join(problems))
    return Profile(name=name, description=description, path=source, checks=tuple(checks),
                   server=server, gsm8k=gsm8k, long_context=long_context, latency=latency,
                   baseline=baseline, thresholds=thresholds, differential=differential,
                   checks_off={str(k): str(v).strip() for k, v in checks_off.items()})


def _top_level(f: Fields, data: dict[str, Any]) -> tuple[str, str, list[str] | None, dict[str, Any]]:
    """The top level: name, description, and which checks run (``checks``) and which are off, with why."""
    problems = f.problems
    name = f.get(data, "", "name", str)
    description = f.get(data, "", "description", str, default="")
    checks = f.get(data, "", "checks", list, default=list(DEFAULTS))
    for c in checks or []:
        if c not in NAMES:
            problems.append(f"checks: unknown check {shown_value(c)} (known: {', '.join(NAMES)})")
    checks_off = f.get(data, "", "checks_off", dict, default={}) or {}
    for c, why in checks_off.items():
        if c not in NAMES:
            problems.append(f"checks_off.{c}: unknown check (known: {', '.join(NAMES)})")
        elif c in (checks or []):
            problems.append(f"checks_off.{c}: the check is also in checks")
        if not isinstance(why, str) or not why.strip():
            problems.append(f"checks_off.{c}: say why the check is off (a non-empty string)")
    return name, description, checks, checks_off


def _server(f: Fields, data: dict[str, Any]) -> tuple[ServerSpec, int]:
    """``server``: the command and environment, and how many tokens it drafts (``--speculative-config``)."""
    problems = f.problems
    s = f.section(data, "server")
    args = f.get(s, "server", "args", list, default=[])
    if any(not isinstance(a, str) for a in args or []):
        problems.append("server.args: every argument must be a string (quote numbers: \"8\")")
        args = []
    env = f.get(s, "server", "env", dict, default={})
    if any(not isinstance(v, str) for v in (env or {}).values()):
        problems.append("server.env: every value must be a string (quote numbers: \"1\")")
        env = {}
    model = f.get(s, "server", "model", str)
    server = ServerSpec(
        model=model or "", served_model_name=f.get(s, "server", "served_model_name", str, default=model or ""),
        args=tuple(args or ()), env=dict(env or {}), host=f.get(s, "server", "host", str, default="127.0.0.1"),
        port=f.get(s, "server", "port", int, default=8000, positive=True, high=MAX_PORT) or 8000,
        ready_timeout_s=f.get(s, "server", "ready_timeout_s", float, default=1800.0, positive=True) or 1800.0,
        vllm_bin=f.get(s, "server", "vllm_bin", str, default="vllm"),
        attach_timeout_s=f.get(s, "server", "attach_timeout_s", float, default=30.0, positive=True) or 30.0,
    )
    spec_tokens = 0
    try:
        spec_tokens = server.speculative_tokens
    except (ValueError, AttributeError, TypeError) as exc:
        problems.append(f"server.args: {exc}")
    return server, spec_tokens


def _gsm8k(f: Fields, data: dict[str, Any]) -> Gsm8kSpec:
    """``gsm8k``: the GSM8K check's options."""
    g = f.section(data, "gsm8k")
    gsm8k = Gsm8kSpec(
        num_fewshot=f.get(g, "gsm8k", "num_fewshot", int, default=5),
        max_gen_toks=f.get(g, "gsm8k", "max_gen_toks", int, default=4096, positive=True),
        concurrency=f.get(g, "gsm8k", "concurrency", int, default=32, positive=True),
        limit=f.get(g, "gsm8k", "limit", int, default=None, positive=True),
        timeout_s=f.get(g, "gsm8k", "timeout_s", float, default=7200.0, positive=True),
        data=f.get(g, "gsm8k", "data", str, default=None),
    )
    return gsm8k


def _long_context(f: Fields, data: dict[str, Any]) -> LongContextSpec:
    """``long_context``: the long-context check's options, its prompts past ``index_topk`` and the workspace."""
    problems = f.problems
    lc = f.section(data, "long_context")
    prompt_tokens = f.get(lc, "long_context", "prompt_tokens", list) or []
    if any(not isinstance(n, int) or n <= 0 for n in prompt_tokens):
        problems.append(f"long_context.prompt_tokens: expected positive integers, got {shown_value(prompt_tokens)}")
        prompt_tokens = []
    long_context = LongContextSpec(
        index_topk=f.get(lc, "long_context", "index_topk", int, positive=True) or 0,
        workspace_capacity_tokens=f.get(lc, "long_context", "workspace_capacity_tokens", int,
                                        default=1408, positive=True) or 1408,
        prompt_tokens=tuple(prompt_tokens),
        max_tokens=f.get(lc, "long_context", "max_tokens", int, default=1024, positive=True),
        count_to=f.get(lc, "long_context", "count_to", int, default=200, positive=True),
        repeats=f.get(lc, "long_context", "repeats", int, default=3, positive=True),
        request_timeout_s=f.get(lc, "long_context", "request_timeout_s", float, default=600.0, positive=True),
        extra_body=f.get(lc, "long_context", "extra_body", dict, default={}),
    )
    if prompt_tokens and long_context.index_topk:
        if max(prompt_tokens) <= long_context.index_topk:
            problems.append(f"long_context.prompt_tokens: none is longer than index_topk "
                            f"{long_context.index_topk}; the sparse top-k path would go untested")
        if max(prompt_tokens) <= long_context.workspace_capacity_tokens:
            problems.append(f"long_context.prompt_tokens: none is longer than workspace_capacity_tokens "
                            f"{long_context.workspace_capacity_tokens}; the workspace overflow would go untested")
    return long_context


def _differential(f: Fields, data: dict[str, Any], checks: list[str] | None) -> DifferentialSpec:
    """``differential``: the differential check's prompts and decoding (optional: defaults)."""
    problems = f.problems
    dd = f.section(data, "differential", optional=True)
    dflt = DifferentialSpec()
    d_prompts = f.get(dd, "differential", "prompt_tokens", list, default=list(dflt.prompt_tokens)) or []
    if not d_prompts or any(isinstance(n, bool) or not isinstance(n, int) or n <= 1 for n in d_prompts):
        problems.append(f"differential.prompt_tokens: expected integers > 1, got {shown_value(d_prompts)}")
        d_prompts = list(dflt.prompt_tokens)
    d_range = f.get(dd, "differential", "token_range", list, default=list(dflt.token_range)) or []
    if (len(d_range) != 2 or any(isinstance(n, bool) or not isinstance(n, int) for n in d_range)
            or not 0 <= d_range[0] < d_range[1]):
        problems.append("differential.token_range: expected [low, high) token ids, 0 <= low < high, "
                        f"got {shown_value(d_range)}")
        d_range = list(dflt.token_range)
    differential = DifferentialSpec(
        prompt_tokens=tuple(d_prompts), token_range=(d_range[0], d_range[1]),
        seed=f.get(dd, "differential", "seed", int, default=dflt.seed),
        max_tokens=f.get(dd, "differential", "max_tokens", int, default=dflt.max_tokens, positive=True),
        top_logprobs=f.get(dd, "differential", "top_logprobs", int, default=dflt.top_logprobs, positive=True),
        index_topk=f.get(dd, "differential", "index_topk", int, default=dflt.index_topk, positive=True),
        spread_runs=f.get(dd, "differential", "spread_runs", int, default=dflt.spread_runs, positive=True),
        request_timeout_s=f.get(dd, "differential", "request_timeout_s", float, default=dflt.request_timeout_s,
                                positive=True),
    )
    if "differential" in (checks or []) and max(differential.prompt_tokens) <= differential.index_topk:
        problems.append(f"differential.prompt_tokens: none is longer than index_topk {differential.index_topk}; "
                        "the sparse top-k path would go uncompared")
    return differential


def _latency(f: Fields, data: dict[str, Any]) -> LatencySpec:
    """``latency``: the latency check's options."""
    problems = f.problems
    la = f.section(data, "latency")
    latency = LatencySpec(
        tool=f.get(la, "latency", "tool", str, default="vllm-bench"),
        input_len=f.get(la, "latency", "input_len", int, default=4096, positive=True),
        output_len=f.get(la, "latency", "output_len", int, default=512, positive=True),
        num_prompts=f.get(la, "latency", "num_prompts", int, default=1, positive=True),
        timeout_s=f.get(la, "latency", "timeout_s", float, default=1800.0, positive=True),
    )
    if latency.tool not in LATENCY_TOOLS:
        problems.append(f"latency.tool: {shown_value(latency.tool)} is not one of {', '.join(LATENCY_TOOLS)}")
    return latency


def _baseline(f: Fields, data: dict[str, Any], checks: list[str] | None, spec_tokens: int,
              latency: LatencySpec) -> Baseline:
    """``baseline``: the numbers the checks compare with, and where they came from."""
    problems = f.problems
    b = f.section(data, "baseline")
    bg = f.get(b, "baseline", "gsm8k", dict, default={}) or {}
    gsm8k_base: dict[str, float] = {}
    for metric in GSM8K_METRICS:
        value = f.get(bg, "baseline.gsm8k", metric, float, low=0, high=1)
        if value is not None:
            gsm8k_base[metric] = value
    bl = f.get(b, "baseline", "latency", dict, default={}) or {}
    acc = f.get(b, "baseline", "acceptance_per_position", list, default=None)
    if acc is not None and any(isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= 1
                               for x in acc):
        problems.append(f"baseline.acceptance_per_position: expected rates in [0, 1], got {shown_value(acc)}")
        acc = None
    if "acceptance" in (checks or []) and spec_tokens:
        if acc is None:
            problems.append("baseline.acceptance_per_position: missing (the server speculates)")
        elif len(acc) != spec_tokens:
            problems.append(f"baseline.acceptance_per_position: {len(acc)} positions, but "
                            f"--speculative-config drafts {spec_tokens}")
    baseline = Baseline(
        source=f.get(b, "baseline", "source", str),
        gsm8k=gsm8k_base,
        gsm8k_stderr=f.get(bg, "baseline.gsm8k", "stderr", float, low=0),
        mean_ttft_ms=f.get(bl, "baseline.latency", "mean_ttft_ms", float, positive=True),
        mean_tpot_ms=f.get(bl, "baseline.latency", "mean_tpot_ms", float, positive=True),
        acceptance_per_position=tuple(float(x) for x in acc) if acc is not None else None,
        latency_tool=f.get(bl, "baseline.latency", "tool", str) or "",
    )
    if baseline.latency_tool and baseline.latency_tool not in LATENCY_TOOLS:
        problems.append(f"baseline.latency.tool: {shown_value(baseline.latency_tool)} is not one of "
                        f"{', '.join(LATENCY_TOOLS)}")
    elif baseline.latency_tool and "latency" in (checks or []) and latency.tool != baseline.latency_tool:
        problems.append(f"latency.tool: {latency.tool}, but baseline.latency.tool is {baseline.latency_tool}; "
                        "the two tools do not measure the same thing: measure a baseline with the tool you run")
    return baseline


def _thresholds(f: Fields, data: dict[str, Any], checks: list[str] | None) -> dict[str, Threshold]:
    """``thresholds``: each with its value and why; exactly those the checks this profile runs read."""
    problems = f.problems
    t = f.section(data, "thresholds")
    needed = {n for c in (checks or []) for n in THRESHOLDS.get(c, ())}
    known = {n for names in THRESHOLDS.values() for n in names}
    thresholds: dict[str, Threshold] = {}
    for key, raw in t.items():
        if key not in known:
            problems.append(f"thresholds.{key}: unknown threshold (known: {', '.join(sorted(known))})")
            continue
        if not isinstance(raw, dict):
            problems.append(f"thresholds.{key}: expected a mapping with value and why")
            continue
        value = f.get(raw, f"thresholds.{key}", "value", float, positive=True,
                      high=HIGH[key])  # the range its check declares (checks.rate / above_zero)
        why = f.get(raw, f"thresholds.{key}", "why", str)
        if isinstance(why, str) and not why.strip():
            problems.append(f"thresholds.{key}.why: empty (every threshold says why)")
        if value is not None and why:
            thresholds[key] = Threshold(value, why.strip())
    for key in sorted(needed - set(t)):
        problems.append(f"thresholds.{key}: missing (needed by the checks this profile runs)")
    return thresholds
