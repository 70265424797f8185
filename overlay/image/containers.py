"""Container engines for ``make image`` and ``make image-smoke``: which one is usable, and its commands.

Three engines build the same Dockerfile with the same arguments: ``docker`` (a daemon, BuildKit),
``podman`` and ``buildah`` (daemonless). :func:`select_engine` takes the one named (``ENGINE=``)
or the first usable of :data:`ENGINES`, and says in one line what it tried when none is.

A daemonless engine on a machine without systemd (a container, a CI sandbox) needs a few flags,
all in :data:`SANDBOX` and nowhere else: builds run ``RUN`` steps with chroot isolation, and
containers run with the cgroupfs manager, file events, ``runc`` (``crun`` fails on setrlimit
there), no network, and the ulimits this process has (the engine's defaults are above what such
a machine grants). ``--sandbox auto`` turns them on when systemd is not running.

``make image-smoke`` keeps its images out of the user's own storage: podman and buildah get one
storage root (:func:`smoke_store`, ``VLLM_OVERLAY_CONTAINERS``), with the overlay driver where
the kernel mounts it and vfs where not; docker keeps its daemon's store.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from overlay.errors import OverlayError

ENGINES = ("docker", "podman", "buildah")
PROBE_TIMEOUT = 30  # seconds an engine's `info` may take before it counts as not answering


class EngineError(OverlayError):
    """No container engine is usable, or one failed a command."""


@dataclass(frozen=True)
class Sandbox:
    """The flags a daemonless engine needs without systemd; one place, read by :class:`Engine`."""

    isolation: tuple[str, ...] = ("--isolation", "chroot")  # podman/buildah build, buildah run: no runc
    global_: tuple[str, ...] = ("--cgroup-manager=cgroupfs", "--events-backend=file", "--runtime", "runc")

    @staticmethod
    def ulimits() -> tuple[str, ...]:
        """``--ulimit`` flags at this process's own limits, capped by the kernel's ceiling for each
        (``fs/nr_open``, ``kernel/pid_max``: such a machine refuses a process limit above pid_max)."""
        flags: list[str] = []
        for name, which, ceiling in (("nofile", resource.RLIMIT_NOFILE, "/proc/sys/fs/nr_open"),
                                     ("nproc", resource.RLIMIT_NPROC, "/proc/sys/kernel/pid_max")):
            cap = _read_int(ceiling)
            soft, hard = (cap if v == resource.RLIM_INFINITY else min(v, cap) for v in resource.getrlimit(which))
            flags += ["--ulimit", f"{name}={soft}:{hard}"]
        return tuple(flags)


def _read_int(path: str) -> int:
    """The number in a /proc/sys file; Linux's usual 4194304 (pid_max's maximum) where it cannot be read."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 4194304


SANDBOX = Sandbox()


def sandbox_wanted(setting: str) -> bool:
    """``--sandbox``: ``1`` on, ``0`` off, ``auto`` on when systemd is not running here."""
    if setting not in ("auto", "1", "0"):
        raise EngineError(f"SANDBOX {setting!r} is not one of auto, 1, 0")
    if setting == "auto":
        return not Path("/run/systemd/system").is_dir()
    return setting == "1"


def smoke_store() -> Path:
    """The one storage root of ``make image-smoke`` for podman and buildah."""
    env = os.environ.get("VLLM_OVERLAY_CONTAINERS", "").strip()
    return Path(env) if env else Path.home() / ".local" / "share" / "vllm-overlay" / "containers"


def runroot(driver: str) -> Path:
    """The transient state beside :func:`smoke_store` (podman wants it under 50 characters)."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp")
    return base / f"vllm-overlay-{os.getuid()}-{driver}"


@dataclass(frozen=True)
class Engine:
    """A usable engine and the flags it is run with; the command builders are pure."""

    name: str  # docker | podman | buildah
    exe: str
    sandbox: bool = False
    store: Path | None = None  # own storage root (podman, buildah)
    driver: str = ""  # its storage driver
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def daemonless(self) -> bool:
        return self.name != "docker"

    def global_flags(self) -> list[str]:
        flags: list[str] = []
        if self.daemonless and self.store is not None:
            flags += ["--root", str(self.store / self.driver), "--runroot", str(runroot(self.driver)),
                      "--storage-driver", self.driver]
        if self.name == "podman" and self.sandbox:
            flags += SANDBOX.global_
        return flags

    def _cmd(self, *args: str) -> list[str]:
        return [self.exe, *self.global_flags(), *args]

    def build_command(self, *, dockerfile: str, context: str, build_args: Mapping[str, str],
                      tags: Sequence[str], target: str = "", labels: Mapping[str, str] | None = None,
                      push: bool = False, ignorefile: str = "", layers: bool = True) -> list[str]:
        """One build; ``push`` only for docker (BuildKit pushes while building; see :meth:`push_commands`).
        ``ignorefile``: the Dockerfile's own ignore file, which BuildKit finds by its name by itself.
        ``layers=False``: podman and buildah keep no per-step images (one layer, less disk)."""
        cmd = self._cmd("build", "-f", dockerfile)
        if self.daemonless:  # as docker: the local image when there is one, else pulled
            cmd += ["--pull=missing", *(SANDBOX.isolation if self.sandbox else ())]
            cmd += ["--ignorefile", ignorefile] if ignorefile else []
            cmd += [] if layers else ["--layers=false"]
        if target:
            cmd += ["--target", target]
        for k, v in build_args.items():
            cmd += ["--build-arg", f"{k}={v}"]
        for k, v in (labels or {}).items():
            cmd += ["--label", f"{k}={v}"]
        for t in tags:
            cmd += ["-t", t]
        if push and not self.daemonless:
            cmd.append("--push")
        return [*cmd, context]

    def push_commands(self, tags: Sequence[str]) -> list[list[str]]:
        """The pushes after a build: none for docker (done by ``build --push``), one per tag otherwise."""
        return [self._cmd("push", t) for t in tags] if self.daemonless else []

    def run_command(self, image: str, args: Sequence[str], *, entrypoint: str | None = None,
                    env: Mapping[str, str] | None = None, stdin: bool = False) -> list[str]:
        """``run --rm`` for docker and podman (buildah runs through :meth:`run`); no network: the
        tool's containers (the smoke) need none."""
        cmd = self._cmd("run", "--rm", "--network=none")
        if self.sandbox and self.daemonless:
            cmd += SANDBOX.ulimits()
        if stdin:
            cmd.append("-i")
        for k, v in (env or {}).items():
            cmd += ["-e", f"{k}={v}"]
        if entrypoint is not None:
            cmd += ["--entrypoint", entrypoint]
        return [*cmd, image, *args]

    def prune_commands(self) -> list[list[str]]:
        """What a build leaves in a storage root of our own (:func:`smoke_store`): dangling images, and
        buildah's working containers (buildah 1.28 leaves some of a multi-stage build). None elsewhere."""
        if not self.daemonless or self.store is None:
            return []
        if self.name == "buildah":
            return [self._cmd("rm", "--all"), self._cmd("rmi", "--prune")]
        return [self._cmd("image", "prune", "-f")]

    def inspect_command(self, image: str) -> list[str]:
        if self.name == "buildah":
            return self._cmd("inspect", "--type", "image", image)
        return self._cmd("image", "inspect", image)

    def remove_command(self, image: str) -> list[str]:
        return self._cmd("rmi", image) if self.name == "buildah" else self._cmd("image", "rm", image)

    # ----------------------------------------------------------------- running

    def call(self, cmd: list[str], *, capture: bool = False, input_text: str | None = None,
             timeout: float | None = None, tee: bool = False) -> subprocess.CompletedProcess[str]:
        """Run ``cmd``. Its output goes to stderr (progress), or is captured (``capture``), or both
        (``tee``: shown line by line and returned); ``timeout`` gives exit 124 with the output so far."""
        env = {**os.environ, **self.env}
        if tee:
            return _tee(cmd, env)
        try:
            return subprocess.run(cmd, stdout=subprocess.PIPE if capture else sys.stderr,
                                  stderr=subprocess.STDOUT if capture else sys.stderr,
                                  input=input_text, text=True, timeout=timeout, check=False, env=env,
                                  stdin=None if input_text is not None else subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            got = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else (exc.output or "")
            return subprocess.CompletedProcess(cmd, 124, got, None)

    def config(self, image: str) -> dict[str, object]:
        """The image's ``Labels`` and ``Entrypoint`` (None where it has none)."""
        proc = self.call(self.inspect_command(image), capture=True)
        if proc.returncode != 0:
            raise EngineError(f"{self.name}: cannot inspect {image}: {last_line(proc.stdout)}")
        doc = json.loads(proc.stdout)
        if self.name == "buildah":
            conf = (doc.get("OCIv1") or {}).get("config") or {}
        else:
            conf = (doc[0] if isinstance(doc, list) else doc).get("Config") or {}
        return {"Labels": conf.get("Labels") or {}, "Entrypoint": conf.get("Entrypoint")}

    def exists(self, image: str) -> bool:
        return self.call(self.inspect_command(image), capture=True).returncode == 0

    def run(self, image: str, args: Sequence[str], *, entrypoint: Sequence[str] | None = None,
            env: Mapping[str, str] | None = None, input_text: str | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        """Run a container of ``image`` and capture its output (stdout and stderr together).

        ``entrypoint`` replaces the image's; None keeps it (buildah, which has no ``run`` of an image,
        reads it from the image and runs it in a working container it removes afterwards)."""
        if self.name != "buildah":
            ep, rest = (entrypoint[0], [*entrypoint[1:], *args]) if entrypoint else (None, list(args))
            return self.call(self.run_command(image, rest, entrypoint=ep, env=env, stdin=input_text is not None),
                             capture=True, input_text=input_text, timeout=timeout)
        argv = [*(entrypoint if entrypoint is not None else self.config(image)["Entrypoint"] or []), *args]  # type: ignore[misc]
        made = self.call(self._cmd("from", "--pull=never", image), capture=True)
        if made.returncode != 0:
            raise EngineError(f"buildah: cannot start a container of {image}: {last_line(made.stdout)}")
        box = made.stdout.strip().splitlines()[-1]
        try:
            cmd = self._cmd("run", *(SANDBOX.isolation if self.sandbox else ()))
            for k, v in (env or {}).items():
                cmd += ["--env", f"{k}={v}"]
            return self.call([*cmd, box, "--", *argv], capture=True, input_text=input_text, timeout=timeout)
        finally:
            self.call(self._cmd("rm", box), capture=True)


def _tee(cmd: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` showing its output on stderr as it comes, and return it."""
    seen: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stderr.write(line)
            seen.append(line)
    sys.stderr.flush()
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(seen), None)


def last_line(text: str | None) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def _probe(cmd: list[str]) -> str | None:
    """Why ``cmd`` (an engine's ``info``) says the engine is not usable, or None when it is."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT, check=False,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"`{' '.join(cmd[:1] + cmd[-1:])}` did not answer in {PROBE_TIMEOUT} s"
    except OSError as exc:
        return f"`{cmd[0]}` does not run: {exc.strerror}"
    if proc.returncode != 0:
        return f"`{Path(cmd[0]).name} info` failed: {last_line(proc.stderr or proc.stdout)}"
    return None


def probe_engine(name: str, *, sandbox: bool, store: Path | None = None) -> Engine | str:
    """The engine ``name`` ready to use, or why not (one phrase)."""
    exe = shutil.which(name)
    if exe is None:
        return "not on PATH"
    if name == "docker":
        why = _probe([exe, "info", "--format", "{{.ServerVersion}}"])
        return why or Engine(name, exe, sandbox=False, env={"DOCKER_BUILDKIT": "1"})
    drivers = ("overlay", "vfs") if store is not None else ("",)
    whys = []
    for driver in drivers:  # overlay where the kernel mounts it (containers/storage tries a mount), else vfs
        engine = Engine(name, exe, sandbox=sandbox, store=store, driver=driver)
        why = _probe(engine._cmd("info"))
        if why is None:
            return engine
        whys.append(f"{driver + ': ' if driver else ''}{why}")
    return "; ".join(whys)


def select_engine(wanted: str = "", *, sandbox: str = "auto", store: Path | None = None) -> Engine:
    """``wanted`` (docker, podman or buildah) or the first usable of :data:`ENGINES`; a one-line
    :class:`EngineError` naming each engine tried and why it is not usable."""
    if wanted and wanted not in ENGINES:
        raise EngineError(f"ENGINE {wanted!r} is not one of {', '.join(ENGINES)}")
    on = sandbox_wanted(sandbox)
    tried: list[str] = []
    for name in (wanted,) if wanted else ENGINES:
        got = probe_engine(name, sandbox=on, store=store)
        if isinstance(got, Engine):
            return got
        tried.append(f"{name}: {got}")
    raise EngineError(f"no container engine usable (tried {'; '.join(tried)}); install docker, podman or buildah "
                      "(docs/image/README.md), or print the plan with `make image DRY_RUN=1`")


def describe(engine: Engine) -> str:
    """One line for the output: the engine, its mode and its storage."""
    parts = [engine.name]
    if engine.sandbox and engine.daemonless:
        parts.append("sandbox flags")
    if engine.store is not None and engine.daemonless:
        parts.append(f"storage {engine.store / engine.driver} ({engine.driver})")
    return ", ".join(parts)
