"""Issue 35 item 4, *OS errors as tracebacks*: an ``OSError`` that names a path reaches the command line's
one error path (``overlay.cli.main``) and is one line there, naming the path and what the OS said."""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from overlay.cli import main

REPO = Path(__file__).resolve().parent.parent


def _build_args(root: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["--patches", str(root), "build", "--dist", str(tmp_path / "dist"), *extra]


def test_a_cache_that_is_a_file_is_one_line(one_patch_release, tmp_path: Path, monkeypatch, capsys) -> None:
    """Issue 35 item 4: ``VLLM_OVERLAY_CACHE`` naming a file ended ``make build`` in a NotADirectoryError
    traceback; now one line names the path, the OS error and which part is a file."""
    root, _ = one_patch_release
    cache = tmp_path / "cache"
    cache.write_text("")
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(cache))
    rc = main(_build_args(root, tmp_path))
    err = capsys.readouterr().err
    assert rc == 1
    assert err.splitlines() == [f"error: {cache}/wheels: Not a directory ({cache} is a file, not a folder); it is "
                                f"under the tool's cache {cache} (VLLM_OVERLAY_CACHE)"]


def _read_only(folders: list[Path], argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with ``folders`` read-only: a read-only bind mount in a mount namespace of its own as
    root (root writes through modes), else the modes."""
    if os.geteuid() != 0:
        for f in folders:
            for p in [f, *f.rglob("*")]:
                if p.is_dir():
                    p.chmod(0o555)
        try:
            return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
        finally:
            for f in folders:
                for p in [f, *f.rglob("*")]:
                    if p.is_dir():
                        p.chmod(0o755)
    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("root, and no mount namespace to make a folder read-only in")
    mounts = "".join(f"mount --bind {q} {q} && mount -o remount,ro,bind {q} && "
                     for q in map(shlex.quote, map(str, folders)))
    return subprocess.run(["unshare", "-m", "sh", "-c", mounts + "exec " + shlex.join(argv)], capture_output=True,
                          text=True, env=env, timeout=120, cwd=REPO)


def _ro_error(path: Path) -> tuple[str, ...]:
    return (f"error: {path}: Read-only file system", f"error: {path}: Permission denied")


def test_a_read_only_cache_is_one_line(one_patch_release, tmp_path: Path) -> None:
    """Issue 35 item 4: a read-only cache folder ended the build in a PermissionError/OSError traceback."""
    root, _ = one_patch_release
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "VLLM_OVERLAY_CACHE": str(cache)}
    proc = _read_only([cache], [sys.executable, "-m", "overlay", *_build_args(root, tmp_path)], env)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(_ro_error(cache / "wheels")), line
    assert line.endswith(f"; it is under the tool's cache {cache} (VLLM_OVERLAY_CACHE)")


def test_a_read_only_venv_is_one_line(one_patch_release, tmp_path: Path) -> None:
    """Issue 35 item 4: ``make build`` into a read-only ``.venv`` ended in a traceback (the install lock
    could not be created); now one line names the path in the environment and the OS error."""
    root, wheel = one_patch_release
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    argv = [sys.executable, "-m", "overlay", *_build_args(root, tmp_path, "--base-wheel", str(wheel), "--install",
                                                           str(venv), "--no-deps")]
    proc = _read_only([venv], argv, dict(os.environ))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    line = proc.stderr.splitlines()[-1]
    assert line.startswith(_ro_error(venv / ".overlay-install.lock")), proc.stderr
    assert line.endswith(f"; it is in the environment {venv} (--install; make: VENV)")


def test_an_os_error_without_a_path_keeps_its_traceback(monkeypatch) -> None:
    """Issue 35 item 4: only an OSError that names a path is a user's one line; any other stays a bug's
    traceback, as every unexpected exception (held before too; a guard)."""
    import overlay.commands.series as series

    def boom(ns):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(series, "cmd_status", boom)
    with pytest.raises(OSError):
        main(["status"])


def test_os_error_line_names_the_part_that_is_a_file(tmp_path: Path) -> None:
    """Issue 35 item 4: the line (new): the path, the OS's words, the ancestor that is a file."""
    from overlay.errors import os_error_line

    (tmp_path / "f").write_text("")
    exc = NotADirectoryError(errno.ENOTDIR, "Not a directory", str(tmp_path / "f" / "a" / "b"))
    assert os_error_line(exc) == f"{tmp_path}/f/a/b: Not a directory ({tmp_path}/f is a file, not a folder)"
    exc = FileExistsError(errno.EEXIST, "File exists", str(tmp_path / "f"))
    assert os_error_line(exc, {str(tmp_path): "in T"}) == (f"{tmp_path}/f: File exists (it is a file, not a "
                                                           "folder); it is in T")


def test_a_folder_named_like_the_wheel_in_dist_is_named_not_the_temporary(one_patch_release, tmp_path: Path,
                                                                           capsys) -> None:
    """Issue 42 cause 4: a folder in ``dist/`` named like the wheel the build writes: the line names that folder.

    Before: ``error: dist/.building-<host>-<pid>-<random>.whl.tmp: cannot write the wheel: Is a directory: ...``:
    ``os.replace``'s error names the source (``filename``, the temporary, removed by then) where the destination
    (``filename2``) is at fault.
    """
    root, _ = one_patch_release
    dist = tmp_path / "dist"
    wheel = tmp_path / "base" / "vllm-0.28.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert main(_build_args(root, tmp_path, "--base-wheel", str(wheel))) == 0
    [built] = dist.glob("*.whl")
    capsys.readouterr()
    built.unlink()
    (built / "inside").mkdir(parents=True)
    rc = main(_build_args(root, tmp_path, "--base-wheel", str(wheel)))
    err = capsys.readouterr().err
    assert rc == 1
    assert err.splitlines() == [f"error: {built}: is a folder where the wheel goes: move it away or build into "
                                "another folder (--dist)"]
    assert (built / "inside").is_dir()
