"""bench-engine's servers: settings, the vllm serve command and environment, start, readiness, death.

Each server runs the projection before the DCP merge at its side's value (``common.FLAGS``: A on, B off, the
twin C on; on everywhere in a null run or a comparison of two trees or sites), spelled the way the build it
serves reads it (:mod:`overlay.releases.projection`): A and C serve the vLLM this process imports (the folder
``importlib.util.find_spec("vllm")`` finds), B the ``--b-tree`` or ``--b-site`` folder where one is given. A
build with the engine argument gets ``--dcp-v-up-proj-before-merge on|off`` among its server's arguments, one
that reads ``VLLM_DCP_PROJECT_BEFORE_MERGE`` the variable in its environment; a build with neither is refused
before any server starts (:func:`projection_plan`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from overlay.bench.engine.cells import Cell
from overlay.bench.engine.common import (
    FLAGS,
    FP8_DS_MLA_BYTES,
    INDEXER_BYTES,
    SERVED_NAME,
    SIDES,
    TWIN,
    BenchError,
    BenchUsageError,
    progress,
)
from overlay.engine.env import PORT_BASE, PORT_STRIDE, REPO, SAFE_ENV, STANDIN, error_cause, error_line
from overlay.regress.server import Server, start_server
from overlay.releases.derive import PROJECTION_ENV
from overlay.releases.projection import ARGUMENT, ProjectionError, folder_switch, server_settings
from overlay.releases.source import importable_tree


def projection_of(side: str, same: bool) -> str:
    """The projection server ``side`` runs: its own value (``FLAGS``), or A's on every server where the run
    compares something else (``same``: a null run, two trees, two sites)."""
    return FLAGS["A"] if same else FLAGS[side]


def projection_plan(sides: list[str], same: bool, b_folder: str = "") -> tuple[dict[str, str | None], dict[str, str]]:
    """(side -> the projection switch of the build it serves, side -> how messages name that build): A and the
    twin the vLLM this process imports, B the folder ``b_folder`` (``--b-tree``, ``--b-site``) where given.
    Read from the trees' files, nothing imported or started; a server whose build cannot take the value it runs
    with (:func:`projection_of`) is refused in one line (:class:`BenchUsageError`)."""
    own = importable_tree()
    try:
        if own is None:
            raise ProjectionError("no vllm importable: the build of server A cannot be read")
        a = folder_switch(own)
        b = folder_switch(Path(b_folder)) if b_folder else a
    except ProjectionError as exc:
        raise BenchUsageError(f"bench-engine: {exc}") from None
    switches: dict[str, str | None] = {}
    builds: dict[str, str] = {}
    for side in sides:
        switches[side], builds[side] = b if side == "B" else a
        value = projection_of(side, same)
        try:
            server_settings(switches[side], value, builds[side])
        except ProjectionError as exc:
            why = "" if same else " (projection on vs off where it cannot be switched would measure nothing)"
            raise BenchUsageError(f"bench-engine: server {side} (projection {value}): {exc}{why}") from None
    return switches, builds


@dataclass
class Settings:
    """Everything the two servers share (and the workload): recorded in ``engine.json``."""

    model: str
    tp: int = 2
    dcp: int = 2
    transport: str = "direct"
    kv_cache_memory_bytes: int = 0
    gpu_memory_utilization: float = 0.3
    max_model_len: int = 0
    max_position_embeddings: int | None = None
    max_num_seqs: int = 0
    max_num_batched_tokens: int | None = None
    prefix_caching: bool = True
    max_cudagraph_capture_size: int = 64
    decode_tokens: int = 128
    repeats: int = 5  # measured runs per server and cell, at least
    cell_seconds: float = 10.0  # more ABBA pairs until each server's measured runs took this long ...
    max_repeats: int = 30  # ... up to this many runs per server
    null: bool = False  # A/A: every server projection on, the ratios are the method's noise
    twin: bool = True  # a third server C with A's projection: A against C is the null of the same run
    seed: int = 0
    mixed_batch: int = 32
    mixed_context: int = 4096
    mixed_interval: float = 0.2
    layers: int = 0
    deep_gemm_standin: bool = True
    extra_args: list[str] = field(default_factory=list)
    # B runs this vLLM tree (first on its PYTHONPATH) instead of the projection off: A/B of two trees,
    # projection on on every server (e.g. engine.variants' mtp-as-prefills)
    b_tree: str = ""
    b_label: str = ""
    # B runs another staged site (scripts/device-run.sh's OVERLAY_DEVICE_SITE of another release's staging):
    # that folder and the paths of its .pth files replace the inherited PYTHONPATH on B alone, so B imports
    # that release's vLLM and its packages, nothing of A's; projection on on every server
    b_site: str = ""
    # per side, how the build it serves switches the projection ("argument", "env") and that build's name
    # (projection_plan; filled on first use where a run's plan did not)
    switches: dict[str, str | None] = field(default_factory=dict)
    builds: dict[str, str] = field(default_factory=dict)

    @property
    def compares_projection(self) -> bool:
        """A and B differ by the projection (not a null run, not two trees or sites)."""
        return not (self.null or self.b_tree or self.b_site)

    def projection(self, side: str) -> str:
        """The projection server ``side`` runs (``on`` / ``off``)."""
        return projection_of(side, not self.compares_projection)

    def spelling(self, side: str) -> tuple[list[str], dict[str, str]]:
        """(server arguments, environment) that give server ``side`` its projection, its build's way."""
        if side not in self.switches:
            self.switches, self.builds = projection_plan(self.sides(), not self.compares_projection,
                                                         "" if self.null else self.b_tree or self.b_site)
        try:
            return server_settings(self.switches[side], self.projection(side), self.builds.get(side, "its build"))
        except ProjectionError as exc:
            raise BenchUsageError(f"bench-engine: server {side}: {exc}") from None

    def server_args(self, side: str | None = None) -> list[str]:
        """The vLLM arguments of server ``side`` (None: those every server shares, without the projection)."""
        args = ["--tensor-parallel-size", str(self.tp), "--decode-context-parallel-size", str(self.dcp),
                "--dcp-comm-backend", "ag_rs" if self.transport == "ag_rs" else "a2a",
                "--kv-cache-dtype", "fp8_ds_mla", "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes),
                "--gpu-memory-utilization", str(self.gpu_memory_utilization),
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
                "--compilation-config", json.dumps({"max_cudagraph_capture_size": self.max_cudagraph_capture_size}),
                "--seed", str(self.seed), "--enable-prompt-tokens-details"]
        if self.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.max_position_embeddings and self.max_model_len > self.max_position_embeddings:
            # the checkpoint's RoPE table ends at max_position_embeddings; a longer one covers the cells
            args += ["--hf-overrides", json.dumps({"max_position_embeddings": self.max_model_len})]
        return args + (self.spelling(side)[0] if side else []) + list(self.extra_args)

    def sides(self) -> list[str]:
        """The servers of the run: A and B, and A's twin C with ``twin``."""
        return [*SIDES, *([TWIN] if self.twin else [])]

    def env(self, side: str, out: Path) -> dict[str, str]:
        """The environment of server ``side`` (A, B or the twin C): besides its own port range and compile
        cache, only the projection's variable differs, where its build reads that (else the argument,
        :meth:`server_args`, and no server inherits the variable)."""
        env = dict(os.environ)
        env.update(SAFE_ENV)
        env["VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"] = "0"
        env.pop(PROJECTION_ENV, None)
        env.update(self.spelling(side)[1])
        if self.transport in ("direct", "a2a"):
            env["VLLM_USE_DIRECT_DCP_A2A"] = "1" if self.transport == "direct" else "0"
        paths = ([str(STANDIN)] if self.deep_gemm_standin else []) + [str(REPO)]
        if self.b_tree and side == "B" and not self.null:
            paths.insert(0, self.b_tree)
        inherited = list(filter(None, [os.environ.get("PYTHONPATH")]))
        if self.b_site and side == "B" and not self.null:
            inherited = site_paths(Path(self.b_site))
        env["PYTHONPATH"] = os.pathsep.join([*paths, *inherited])
        env.setdefault("PYTHONUNBUFFERED", "1")
        slot = list(FLAGS).index(side)
        env["VLLM_PORT"] = str(PORT_BASE + slot * PORT_STRIDE)
        env["VLLM_CACHE_ROOT"] = str(out.parent / f"{out.name}-cache" / f"server-{side}")
        return env


def site_paths(site_dir: Path) -> list[str]:
    """``site_dir`` and the folders its ``.pth`` files add, as ``scripts/device-run.sh`` lists them for its own
    site: a PYTHONPATH entry's ``.pth`` files are not read by Python, and theirs may add a folder only by code
    (nvidia-cutlass-dsl's ``import ...; sys.path.insert(0, ...)`` puts ``cutlass`` on the path). So a fresh
    interpreter, without the inherited PYTHONPATH and with ``site_dir`` first, runs ``site.addsitedir`` on it."""
    code = ("import site, sys\nd = sys.argv[1]\nsys.path.insert(0, d)\nbefore = list(sys.path)\n"
            "site.addsitedir(d)\nprint('\\n'.join(p for p in sys.path if p not in before))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code, str(site_dir)], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    if proc.returncode != 0:
        raise BenchError(f"--b-site {site_dir}: its .pth files do not run: "
                         f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return [str(site_dir), *(line for line in proc.stdout.splitlines() if line and line != str(site_dir))]


def comparison(settings: dict[str, Any], short: bool = False) -> str:
    """What A and B differ in, for titles: the projection before the DCP merge (on vs off; how the builds were
    told, where the settings say), another vLLM tree or staged site, or nothing (null)."""
    if settings.get("null"):
        return "A/A null run" if short else ("A/A null run, projection on on every server: the ratios are the "
                                             "method's noise")
    if settings.get("b_tree") or settings.get("b_site"):
        b = settings.get("b_label") or settings.get("b_tree") or settings["b_site"]
        return f"the series vs {b}" if short else f"A = the series vs B = {b} (projection on on both)"
    if short:
        return "projection on vs off"
    told = sorted({{"argument": ARGUMENT, "env": PROJECTION_ENV}.get(s) or "?"
                   for side, s in (settings.get("switches") or {}).items() if side in SIDES})
    return "projection before the DCP merge A=on vs B=off" + (f" ({' and '.join(told)})" if told else "")


def kv_cache_bytes(tokens_per_gpu: int, layers: int) -> int:
    """A KV cache per GPU for ``tokens_per_gpu`` tokens: fp8_ds_mla + indexer bytes, 25% + 256 MiB margin."""
    return int(tokens_per_gpu * layers * (FP8_DS_MLA_BYTES + INDEXER_BYTES) * 1.25) + (256 << 20)


def largest_tokens(cells: list[Cell], decode_tokens: int) -> int:
    """The most tokens a cell keeps in the cache at once (prefix caching off; the mixed cell's
    prefills counted at a few in flight)."""
    per_cell = [(c.batch + (8 if c.mixed else 0)) * (c.context + decode_tokens + 256) for c in cells]
    return max(per_cell, default=0)


def command(template: str | None, vllm: str, settings: Settings, port: int, side: str) -> list[str]:
    """The server's argv: ``vllm serve`` of the checkpoint, or ``--server-cmd`` with its placeholders
    ({port}, {model}, {name}, {side}, {args}: the vLLM arguments, shell-quoted)."""
    if template:
        filled = template.format(port=port, model=shlex.quote(settings.model), name=SERVED_NAME, side=side,
                                 args=shlex.join(settings.server_args(side)))
        return shlex.split(filled)
    return [*shlex.split(vllm), "serve", settings.model, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", SERVED_NAME, *settings.server_args(side)]


def launch(side: str, cmd: list[str], env: dict[str, str], log_path: Path, port: int,
           projection: str = "") -> BenchServer:
    """Start one server in its own process group (``Server.stop`` signals the group)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        log.write(("$ " + shlex.join(cmd) + "\n").encode())
        log.flush()
        try:
            proc = start_server(cmd, env, log, "127.0.0.1", port)  # bound to the run, recorded until stopped
        except FileNotFoundError:
            raise BenchError(f"server {side}: {cmd[0]!r} not found (--vllm / --server-cmd)") from None
    return BenchServer(side, f"http://127.0.0.1:{port}", proc, log_path, projection)


class BenchServer(Server):
    """A launched server that knows which side (A, B or C) it is and the projection it runs."""

    def __init__(self, side: str, base_url: str, proc: subprocess.Popen[bytes], log_path: Path,
                 projection: str = "") -> None:
        super().__init__(base_url, SERVED_NAME, proc, log_path)
        self.side = side
        self.projection = projection


def side_of(server: Server) -> str:
    return getattr(server, "side", "?")


def death_of(server: Server) -> str | None:
    """None while ``server`` lives; else the one-line error naming it and its log's telling line."""
    if server.alive(attempts=2, pause_s=0.5):
        return None
    side = side_of(server)
    if server.proc is not None:
        try:
            server.proc.wait(timeout=5.0)  # a crashing server is usually gone within moments
        except subprocess.TimeoutExpired:
            pass
    rc = server.exited()
    how = ("stopped answering /health" if rc is None else f"was killed by signal {-rc}" if rc < 0
           else f"exited with status {rc}")
    log = server.log_path.read_text(encoding="utf-8", errors="replace") if server.log_path else ""
    # killed by a signal with no exception logged: the log's last line would be a served request
    why = (error_cause(log) or "(no error in its output)") if rc is not None and rc < 0 else error_line(log)
    projection = getattr(server, "projection", "") or FLAGS.get(side, "?")
    return f"server {side} (projection {projection}) {how}; {server.log_path}: {why}"


def stop_all(servers: list[Server], grace_s: float = 15.0) -> None:
    """Stop the servers side by side (SIGTERM to each group, SIGKILL after ``grace_s``)."""
    import threading

    threads = [threading.Thread(target=s.stop, kwargs={"grace_s": grace_s}) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def wait_ready(servers: list[Server], timeout_s: float) -> None:
    """Until every server answers /health and lists the model; a server that exits ends it at once."""
    start = time.monotonic()
    pending = list(servers)
    next_note = start + 30.0
    while pending:
        for server in list(pending):
            if server.exited() is not None:
                raise BenchError(death_of(server) or f"server {side_of(server)} exited")
            try:
                if server.client.health() and SERVED_NAME in server.client.models():
                    progress(f"server {side_of(server)} ready after {time.monotonic() - start:.0f} s")
                    pending.remove(server)
            except httpx.HTTPError:
                pass
        now = time.monotonic()
        if pending and now - start > timeout_s:
            names = ", ".join(side_of(s) for s in pending)
            raise BenchError(f"server {names} not ready after {timeout_s:.0f} s (--ready-timeout); "
                             f"{pending[0].log_path}: {error_line(pending[0].log_tail(40))}")
        if pending and now >= next_note:
            progress(f"waiting for server {', '.join(side_of(s) for s in pending)} ({now - start:.0f} s)")
            next_note = now + 30.0
        if pending:
            time.sleep(1.0)


