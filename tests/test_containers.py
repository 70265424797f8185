"""Container engine selection and commands (overlay/image/containers.py), with stand-in executables on PATH:
the order docker, podman, buildah; the one-line error naming each engine tried; the sandbox flags in
their one place; the same plan and build arguments for every engine. The last test builds with a
real engine and skips with the reason when none is usable."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from overlay.image.containers import (
    ENGINES,
    SANDBOX,
    Engine,
    EngineError,
    last_line,
    probe_engine,
    runroot,
    sandbox_wanted,
    select_engine,
    smoke_store,
)

LOG = "calls.log"


def fake(bin_dir: Path, name: str, *, info_rc: int = 0, info_err: str = "", inspect: str = "") -> None:
    """An executable ``name`` that logs its argv and answers ``info`` with ``info_rc``."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(
        "#!/bin/sh\n"
        f'echo "{name} $*" >> "{bin_dir / LOG}"\n'
        'for a in "$@"; do\n'
        f'  if [ "$a" = info ]; then [ -n "{info_err}" ] && echo "{info_err}" >&2; exit {info_rc}; fi\n'
        f"  if [ \"$a\" = inspect ]; then printf '%s\\n' '{inspect}'; exit 0; fi\n"  # PATH has no cat
        '  if [ "$a" = from ]; then echo box-1; exit 0; fi\n'
        "done\nexit 0\n")
    script.chmod(0o755)


def calls(bin_dir: Path) -> list[str]:
    log = bin_dir / LOG
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture()
def path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


# --------------------------------------------------------------------------- selection

def test_no_engine_names_every_one_tried(path: Path) -> None:
    fake(path, "docker", info_rc=1, info_err="Cannot connect to the Docker daemon at unix:///var/run/docker.sock.")
    with pytest.raises(EngineError) as exc:
        select_engine()
    assert str(exc.value) == (
        "no container engine usable (tried docker: `docker info` failed: Cannot connect to the Docker daemon at "
        "unix:///var/run/docker.sock.; podman: not on PATH; buildah: not on PATH); install docker, podman or "
        "buildah (docs/image/README.md), or print the plan with `make image DRY_RUN=1`")
    assert "\n" not in str(exc.value)


def test_order_docker_podman_buildah(path: Path) -> None:
    for name in ENGINES:
        fake(path, name)
    assert select_engine(sandbox="0").name == "docker"
    fake(path, "docker", info_rc=1)
    assert select_engine(sandbox="0").name == "podman"
    (path / "podman").unlink()
    assert select_engine(sandbox="0").name == "buildah"
    assert calls(path)[-1].startswith("buildah info")


def test_named_engine_only(path: Path) -> None:
    fake(path, "docker")
    with pytest.raises(EngineError, match=r"^no container engine usable \(tried podman: not on PATH\); "):
        select_engine("podman")
    assert calls(path) == []  # docker, though usable, was not asked
    with pytest.raises(EngineError, match=r"^ENGINE 'rkt' is not one of docker, podman, buildah$"):
        select_engine("rkt")


def test_smoke_store_falls_back_from_overlay_to_vfs(path: Path, tmp_path: Path) -> None:
    """containers/storage tries a real mount for overlay at `info`: where it fails, vfs."""
    script = path / "podman"
    script.write_text(f'#!/bin/sh\necho "podman $*" >> "{path / LOG}"\n'
                      'case "$*" in *"--storage-driver overlay"*) echo "kernel does not support overlay fs" >&2; '
                      "exit 125;; esac\nexit 0\n")
    script.chmod(0o755)
    engine = select_engine("podman", sandbox="0", store=tmp_path / "store")
    assert engine.driver == "vfs"
    assert engine.global_flags()[:2] == ["--root", str(tmp_path / "store" / "vfs")]
    assert [c.split(" --storage-driver ")[1].split()[0] for c in calls(path)] == ["overlay", "vfs"]
    assert isinstance(probe_engine("buildah", sandbox=False), str)


def test_sandbox_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sandbox_wanted("1") and not sandbox_wanted("0")
    assert sandbox_wanted("auto") == (not Path("/run/systemd/system").is_dir())
    with pytest.raises(EngineError, match=r"^SANDBOX 'yes' is not one of auto, 1, 0$"):
        sandbox_wanted("yes")


def test_store_and_runroot_places(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_OVERLAY_CONTAINERS", str(tmp_path / "c"))
    assert smoke_store() == tmp_path / "c"
    monkeypatch.delenv("VLLM_OVERLAY_CONTAINERS")
    assert smoke_store() == Path.home() / ".local/share/vllm-overlay/containers"
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert len(str(runroot("overlay"))) < 50  # podman refuses a longer runroot


# --------------------------------------------------------------------------- commands

ARGS = {"VLLM_VERSION": "0.28.0", "PATCHES": "a.patch b.patch"}


def test_build_commands_differ_only_in_engine_flags() -> None:
    cmds = {name: Engine(name, name, sandbox=True).build_command(
        dockerfile="docker/Dockerfile", context=".", target="runtime", build_args=ARGS, tags=["i:1"])
        for name in ENGINES}
    tail = ["--target", "runtime", "--build-arg", "VLLM_VERSION=0.28.0", "--build-arg", "PATCHES=a.patch b.patch",
            "-t", "i:1", "."]
    assert cmds["docker"] == ["docker", "build", "-f", "docker/Dockerfile", *tail]
    assert cmds["buildah"] == ["buildah", "build", "-f", "docker/Dockerfile", "--pull=missing",
                               *SANDBOX.isolation, *tail]
    assert cmds["podman"] == ["podman", *SANDBOX.global_, "build", "-f", "docker/Dockerfile", "--pull=missing",
                              *SANDBOX.isolation, *tail]


def test_no_sandbox_no_sandbox_flags() -> None:
    engine = Engine("podman", "podman", sandbox=False)
    cmd = engine.build_command(dockerfile="f", context=".", build_args={}, tags=["t"])
    run = engine.run_command("img", ["x"])
    assert not set(SANDBOX.global_ + SANDBOX.isolation) & set(cmd + run)
    assert run == ["podman", "run", "--rm", "--network=none", "img", "x"]


def test_prune_only_in_a_store_of_our_own(tmp_path: Path) -> None:
    assert Engine("docker", "docker", store=tmp_path).prune_commands() == []  # the daemon's store is the user's
    assert Engine("podman", "podman").prune_commands() == []
    flags = ["--root", str(tmp_path / "overlay"), "--runroot", str(runroot("overlay")), "--storage-driver", "overlay"]
    assert Engine("podman", "podman", store=tmp_path, driver="overlay").prune_commands() == [
        ["podman", *flags, "image", "prune", "-f"]]
    assert Engine("buildah", "buildah", store=tmp_path, driver="overlay").prune_commands() == [
        ["buildah", *flags, "rm", "--all"], ["buildah", *flags, "rmi", "--prune"]]
    cmd = Engine("buildah", "buildah").build_command(dockerfile="f", context=".", build_args={}, tags=["t"],
                                                     layers=False)
    assert "--layers=false" in cmd
    assert "--layers=false" not in Engine("docker", "docker").build_command(
        dockerfile="f", context=".", build_args={}, tags=["t"], layers=False)


def test_push_per_engine() -> None:
    docker, podman = Engine("docker", "docker"), Engine("podman", "podman")
    assert docker.build_command(dockerfile="f", context=".", build_args={}, tags=["a", "b"], push=True)[-2] == "--push"
    assert docker.push_commands(["a", "b"]) == []
    assert "--push" not in podman.build_command(dockerfile="f", context=".", build_args={}, tags=["a"], push=True)
    assert podman.push_commands(["a", "b"]) == [["podman", "push", "a"], ["podman", "push", "b"]]


def test_sandbox_run_flags_follow_this_process_limits() -> None:
    cmd = Engine("podman", "podman", sandbox=True).run_command("img", ["a"], entrypoint="python3",
                                                               env={"K": "v"}, stdin=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert cmd[:len(SANDBOX.global_) + 4] == ["podman", *SANDBOX.global_, "run", "--rm", "--network=none"]
    nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    assert f"nofile={min(soft, nr_open)}:{min(hard, nr_open)}" in cmd
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nproc = cmd[cmd.index(next(a for a in cmd if a.startswith("nproc=")))]
    assert all(0 < int(v) <= pid_max for v in nproc.split("=")[1].split(":"))  # runc is refused above pid_max
    assert cmd[-6:] == ["-e", "K=v", "--entrypoint", "python3", "img", "a"]
    assert cmd[cmd.index("-e") - 1] == "-i"


def test_buildah_run_uses_a_working_container(path: Path) -> None:
    config = json.dumps({"OCIv1": {"config": {"Entrypoint": ["vllm", "serve"], "Labels": {"a": "b"}}}})
    fake(path, "buildah", inspect=config)
    engine = Engine("buildah", str(path / "buildah"), sandbox=True)
    assert engine.config("img") == {"Labels": {"a": "b"}, "Entrypoint": ["vllm", "serve"]}
    proc = engine.run("img", ["--help"], env={"K": "v"})
    assert proc.returncode == 0
    log = [c.split(" ", 1)[1] for c in calls(path)]
    assert log[1:] == ["inspect --type image img",  # the entrypoint, which buildah run does not apply
                       "from --pull=never img", "run --isolation chroot --env K=v box-1 -- vllm serve --help",
                       "rm box-1"]


def test_inspect_json_of_docker_and_podman(path: Path) -> None:
    fake(path, "podman", inspect=json.dumps([{"Config": {"Labels": None, "Entrypoint": ["vllm", "serve"]}}]))
    assert Engine("podman", str(path / "podman")).config("x") == {"Labels": {}, "Entrypoint": ["vllm", "serve"]}


def test_call_tee_shows_and_returns(capfd: pytest.CaptureFixture[str]) -> None:
    engine = Engine("docker", "docker")
    proc = engine.call([sys.executable, "-c", "print('one'); print('two'); raise SystemExit(3)"], tee=True)
    assert (proc.returncode, proc.stdout) == (3, "one\ntwo\n")
    assert capfd.readouterr().err == "one\ntwo\n"
    late = engine.call([sys.executable, "-c", "import time; print('x', flush=True); time.sleep(5)"],
                       capture=True, timeout=1)
    assert late.returncode == 124
    assert last_line("a\n\n b \n") == "b" and last_line("") == "no output"


# --------------------------------------------------------------------------- a real engine

def _usable_engine() -> Engine | None:
    if not any(shutil.which(name) for name in ENGINES):
        return None
    try:
        return select_engine(store=smoke_store())
    except EngineError:
        return None


def test_real_engine_builds_labels_and_inspects(tmp_path: Path) -> None:
    """A two-line image from scratch: build with the flags above, read its labels and entrypoint back."""
    engine = _usable_engine()
    if engine is None:
        pytest.skip("no container engine usable here (docker, podman, buildah): engine-dependent test")
    (tmp_path / "hello.txt").write_text("hi\n")
    (tmp_path / "Containerfile").write_text('FROM scratch\nCOPY hello.txt /\nENTRYPOINT ["vllm", "serve"]\n')
    tag = f"localhost/vllm-overlay-engine-test:{os.getpid()}"
    cmd = engine.build_command(dockerfile=str(tmp_path / "Containerfile"), context=str(tmp_path), build_args={},
                               labels={"vllm-overlay.test": "yes"}, tags=[tag])
    proc = engine.call(cmd, capture=True)
    try:
        assert proc.returncode == 0, proc.stdout
        assert engine.exists(tag)
        conf = engine.config(tag)
        assert conf["Entrypoint"] == ["vllm", "serve"] and conf["Labels"]["vllm-overlay.test"] == "yes"
    finally:
        subprocess.run(engine.remove_command(tag), capture_output=True, check=False)
    assert not engine.exists(tag)
