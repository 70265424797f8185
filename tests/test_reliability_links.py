"""Issue 35 item 4, *symlinks followed where they must not be*: a patch adding a link, a ``series`` or
``pin.toml`` that is a link to a file of secrets, a lock file that is a link or a folder.

Each test's docstring says what the code did before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from overlay import lock
from overlay.build.install import LOCK_NAME as INSTALL_LOCK
from overlay.build.install import install
from overlay.build.series import Series
from overlay.cli import main
from overlay.errors import LockError, SeriesError
from tests.wheelkit import A_PY, BASE_FILES, make_release, make_wheel

SECRET = "hunter2-do-not-print-me"
REPO = Path(__file__).resolve().parent.parent


def git_patch(work: Path, before: dict[str, bytes], after: dict[str, bytes | tuple[str, str]],
              subject: str = "Change it", remove: tuple[str, ...] = ()) -> bytes:
    """``git format-patch`` of ``before -> after`` (and ``remove`` removed); a value ``("link", target)`` is
    a symbolic link, ``("exec", text)`` an executable file (mode 100755) holding ``text``."""
    repo = work / "repo"
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_AUTHOR_DATE": "2026-11-30T00:00:00Z",
           "GIT_COMMITTER_DATE": "2026-11-30T00:00:00Z", "PATH": "/usr/bin:/bin", "HOME": str(work)}

    def git(*args: str, input: bytes | None = None) -> bytes:
        return subprocess.run(["git", "-C", str(repo), *args], input=input, env=env, capture_output=True,
                              check=True).stdout

    repo.mkdir()
    git("init", "-q")
    for name, data in before.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    git("add", "-A")
    git("commit", "-q", "--allow-empty", "-m", "base")
    for name, value in after.items():
        dest = repo / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_symlink() or dest.exists():
            dest.unlink()
        if isinstance(value, tuple) and value[0] == "exec":
            dest.write_bytes(value[1].encode())
            dest.chmod(0o755)
        elif isinstance(value, tuple):
            dest.symlink_to(value[1])
        else:
            dest.write_bytes(value)
    for name in remove:
        (repo / name).unlink()
    git("add", "-A")
    git("commit", "-q", "-F", "-", input=f"{subject}\n\nWhy.\n\nOrigin: vendor\nLast-Update: 2026-11-30\n".encode())
    return git("format-patch", "-1", "--stdout", "--zero-commit", "--full-index", "--no-signature",
               "--keep-subject", "--no-stat")


def _release(tmp_path: Path, patch: bytes) -> tuple[Path, Path]:
    d = tmp_path / "base"
    d.mkdir()
    wheel = make_wheel(d, BASE_FILES)
    return make_release(tmp_path, wheel, patches={"leak.patch": patch}), wheel


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err, err
    (line,) = err.splitlines()
    assert line.startswith("error: ")
    return line


@pytest.mark.parametrize("after", [
    pytest.param({"vllm/leak.txt": ("link", "/etc/hostname")}, id="adds-a-link"),
    pytest.param({"vllm/a.py": ("link", "/etc/hostname")}, id="turns-a-file-into-a-link"),
])
def test_a_patch_that_adds_a_symbolic_link_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, after: dict[str, tuple[str, str]],
) -> None:
    """A mode-120000 entry is refused by the patch parser, naming the patch, its line and the path.

    Before: the parser took it for a file; ``git apply`` made the link in the scratch tree and the
    build read through it, so ``/etc/hostname``'s bytes went into the wheel as ``vllm/leak.txt``
    (exit 0), and into ``.venv`` with ``--install``.
    """
    (path,) = after
    root, wheel = _release(tmp_path, git_patch(tmp_path, {"vllm/a.py": A_PY}, after))
    patch = root / "0.28.0" / "leak.patch"
    with pytest.raises(SeriesError) as exc:
        Series.load(root / "0.28.0")
    assert str(exc.value).startswith(f"{patch}:")
    assert f": {path}: mode 120000 (a symbolic link); a patch may only add or change regular files" in str(exc.value)
    dist = tmp_path / "dist"
    line = _one_line(capsys, ["--patches", str(root), "build", "--dist", str(dist), "--base-wheel", str(wheel)])
    assert line == f"error: {exc.value}"
    assert not any(dist.glob("*.whl"))


def _cli_in_a_process(argv: list[str]) -> str:
    """``overlay ARGV`` in its own process, with the secret in its environment (``/proc/self/environ`` shows
    a process's environment as it started); its one ``error:`` line."""
    env = {**os.environ, "OVERLAY_TEST_SECRET": SECRET}
    proc = subprocess.run([sys.executable, "-m", "overlay", *argv], env=env, capture_output=True, text=True,
                          errors="replace", cwd=REPO)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: ")
    return line


def _secret_file(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "elsewhere" / "secrets"
    f.parent.mkdir()
    f.write_text(text)
    return f


@pytest.mark.parametrize("case", ["series-environ", "series-long-line", "series-control-chars",
                                  "pin-environ", "pin-long-value", "pin-unknown-key"])
def test_a_series_or_pin_that_is_a_link_to_secrets_is_not_echoed(tmp_path: Path, case: str) -> None:
    """Error lines quote a piece of a file only when it is short and printable (``overlay.errors.shown``).

    Before: a ``series`` linked to ``/proc/self/environ`` printed the whole environment, NUL-separated, in
    ``patch name must not contain '/': 'OVERLAY_TEST_SECRET=hunter2...'``; a series line of 200 characters
    or with control characters and a pin field or key of 200 characters were printed whole. (A
    ``pin.toml`` linked to ``/proc/self/environ`` was already only "not valid TOML (at line 1, ...)".)

    Since issue 42 (cause 2) a link out of the patches folder is refused before it is read
    (:func:`test_a_file_under_patches_that_links_out_is_refused_unread`); so that the bound on what is quoted
    is still held here, the long and control-character texts are the files' own content, not a link's.
    """
    root, wheel = _release(tmp_path, git_patch(tmp_path, {"vllm/a.py": A_PY}, {"vllm/a.py": A_PY + b"x = 1\n"}))
    release = root / "0.28.0"
    what, _, kind = case.partition("-")
    texts = {
        "long-line": f"token{SECRET * 10}.patch\n",
        "control-chars": f"a.patch\x1b]0;{SECRET}\x07\n",
        "long-value": f'version = "{SECRET * 10}"\nwheel = "w"\nsha256 = "s"\n',
        "unknown-key": f'version = "0.28.0"\n{"k" + SECRET * 10} = 1\n',
    }
    link = release / ("series" if what == "series" else "pin.toml")
    link.unlink()
    if kind == "environ":
        link.symlink_to("/proc/self/environ")
    else:
        link.write_text(texts[kind])
    line = _cli_in_a_process(["--patches", str(root), "build", "--dist", str(tmp_path / "d"),
                              "--base-wheel", str(wheel)])
    assert line.startswith(f"error: {link}")
    assert SECRET not in line and "\x00" not in line and "\x1b" not in line
    assert len(line) < 400


def test_a_short_printable_series_line_is_still_quoted() -> None:
    """The bound keeps what helps: a typo in a series line is shown as before."""
    with pytest.raises(SeriesError, match=r"^s:1: not a patch file name \(want 'topic-name.patch'\): 'fix-a.pach'$"):
        Series.parse_names("fix-a.pach\n", "s")


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("do not overwrite\n")
    return victim


def test_a_build_lock_that_is_a_link_is_refused_not_written_through(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, one_patch_release: tuple[Path, Path],
) -> None:
    """``dist/.overlay-build.lock`` a symbolic link: one line, the file it points at untouched.

    Before: the lock was opened through the link and ``pid host since`` written over the target
    (here ``victim.txt``), and the build went on (exit 0).
    """
    root, wheel = one_patch_release
    dist = tmp_path / "dist"
    dist.mkdir()
    victim = _victim(tmp_path)
    (dist / ".overlay-build.lock").symlink_to(victim)
    line = _one_line(capsys, ["--patches", str(root), "build", "--dist", str(dist), "--base-wheel", str(wheel)])
    assert line == (f"error: {dist / '.overlay-build.lock'}: is a symbolic link, not a lock file (a lock is never "
                    "written through a link): remove it")
    assert victim.read_text() == "do not overwrite\n"
    assert not any(dist.glob("*.whl"))


def test_a_build_lock_that_is_a_folder_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, one_patch_release: tuple[Path, Path],
) -> None:
    """``dist/.overlay-build.lock`` a folder: one line saying so.

    Before: ``error: dist/.overlay-build.lock: cannot write the wheel: Is a directory: check dist ...``,
    which blames the wheel.
    """
    root, wheel = one_patch_release
    dist = tmp_path / "dist"
    (dist / ".overlay-build.lock").mkdir(parents=True)
    line = _one_line(capsys, ["--patches", str(root), "build", "--dist", str(dist), "--base-wheel", str(wheel)])
    assert line == f"error: {dist / '.overlay-build.lock'}: is a folder, not a lock file: remove it"


@pytest.mark.parametrize("shape", ["link", "dangling-link", "folder"])
def test_an_install_lock_that_is_a_link_or_a_folder_is_one_line(tmp_path: Path, shape: str) -> None:
    """``.venv/.overlay-install.lock`` a link or a folder: a :class:`LockError` (one line), nothing written.

    Before: a link was written through (the target's content replaced by ``pid host since``), a dangling
    one created its target, and a folder raised ``IsADirectoryError`` (a traceback).
    """
    env = tmp_path / "venv"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("#!/bin/false\n")
    victim = _victim(tmp_path)
    path = env / INSTALL_LOCK
    if shape == "link":
        path.symlink_to(victim)
    elif shape == "dangling-link":
        path.symlink_to(tmp_path / "created-through-the-link")
    else:
        path.mkdir()
    wheel = tmp_path / "vllm-0.28.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    zipfile.ZipFile(wheel, "w").close()
    with pytest.raises(LockError) as exc:
        install(wheel, env)
    assert str(exc.value).startswith(f"{path}: is a ")
    assert victim.read_text() == "do not overwrite\n"
    assert not (tmp_path / "created-through-the-link").exists()


def test_a_lock_on_a_device_is_refused(tmp_path: Path) -> None:
    """A lock path that opens but is no plain file (a FIFO): one line. Before: ``OSError: Illegal seek`` from
    writing the holder's record into it (a traceback)."""
    fifo = tmp_path / "fifo.lock"
    os.mkfifo(fifo)
    with pytest.raises(LockError, match=r"is not a plain file, so not a lock file: remove it$"), \
            lock.held(fifo, "test"):
        pass


@pytest.mark.parametrize("what", ["series", "pin", "patch", "release-folder", "default"])
def test_a_file_under_patches_that_links_out_is_refused_unread(tmp_path: Path, what: str) -> None:
    """Issue 42 cause 2: a ``series``, ``pin.toml``, patch or ``patches/DEFAULT`` that is a symbolic link out of
    the patches folder (or a release folder that is one) is refused, naming the link, before it is read; the
    secret it points at, short and printable, is in no error line.

    Before: ``ln -s /tmp/secret patches/0.28.0/series; overlay build`` printed the secret's first line
    (``not a patch file name (want 'topic-name.patch'): 'hunter2-...'``), and a pin linked so printed its
    version field; a patch or a release folder linked out was read as if it were the series' own.
    """
    root, wheel = _release(tmp_path, git_patch(tmp_path, {"vllm/a.py": A_PY}, {"vllm/a.py": A_PY + b"x = 1\n"}))
    release = root / "0.28.0"
    secrets = _secret_file(tmp_path, f'version = "{SECRET}"\n' if what == "pin" else f"{SECRET}\n")
    if what == "release-folder":
        elsewhere = tmp_path / "elsewhere" / "0.28.0"
        release.rename(elsewhere)
        (elsewhere / "series").write_text(f"{SECRET}\n")
        release.symlink_to(elsewhere)
        link = release / "pin.toml"  # the first file the build reads there
    else:
        link = {"series": release / "series", "pin": release / "pin.toml", "patch": release / "leak.patch",
                "default": root / "DEFAULT"}[what]
        link.unlink(missing_ok=True)
        link.symlink_to(secrets)
    line = _cli_in_a_process(["--patches", str(root), "build", "--dist", str(tmp_path / "d"), "--base-wheel",
                              str(wheel), *([] if what == "default" else ["--vllm", "0.28.0"])])
    assert line.startswith(f"error: {link}: reached through a symbolic link out of {root} ("), line
    assert line.endswith("a series, pin or patch is read only from inside the patches folder: put the file itself "
                         "there"), line
    assert SECRET not in line


@pytest.mark.parametrize(("after", "change"), [
    pytest.param({"vllm/a.py": ("exec", A_PY.decode())}, "changes its mode (100644 -> 100755)", id="mode-only"),
    pytest.param({"vllm/a.py": ("exec", A_PY.decode() + "x = 1\n")}, "changes its mode (100644 -> 100755)",
                 id="mode-and-content"),
    pytest.param({"vllm/tool.py": ("exec", "print(1)\n")}, "adds it with mode 100755", id="new-executable"),
])
def test_a_patch_that_changes_a_files_mode_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, after: dict[str, tuple[str, str]], change: str,
) -> None:
    """Issue 42 cause 6: a patch whose diff changes a file's mode (``old mode 100644`` / ``new mode 100755``), or
    adds a file of mode 100755: one line naming the patch, its line and the file; nothing built.

    Before: a mode-only patch was dropped without a word (its bytes the same, nothing "changed"): exit 0, the
    wheel's file still 644; with a content change too, or a new executable file, the content went in and the
    mode was lost (the wheel writes members with the base's mode, new ones 100644).
    """
    (path,) = after
    root, wheel = _release(tmp_path, git_patch(tmp_path, {"vllm/a.py": A_PY}, after))
    patch = root / "0.28.0" / "leak.patch"
    with pytest.raises(SeriesError) as exc:
        Series.load(root / "0.28.0")
    message = str(exc.value)
    assert message.startswith(f"{patch}:"), message
    assert message.endswith(f": {path}: {change}; the wheel keeps each file's mode (a new file's is 100644): "
                            "take the mode change out of the patch"), message
    dist = tmp_path / "dist"
    line = _one_line(capsys, ["--patches", str(root), "build", "--dist", str(dist), "--base-wheel", str(wheel)])
    assert line == f"error: {message}"
    assert not any(dist.glob("*.whl"))


def test_a_link_loop_under_patches_is_one_line(tmp_path: Path) -> None:
    """Issue 42 cause 2, beside it: a ``series`` that is a link loop (``series -> loop -> series``) is one line, not
    the ``RuntimeError: Symlink loop`` that following links raises."""
    root, _ = _release(tmp_path, git_patch(tmp_path, {"vllm/a.py": A_PY}, {"vllm/a.py": A_PY + b"x = 1\n"}))
    series = root / "0.28.0" / "series"
    series.unlink()
    series.symlink_to("loop")
    (root / "0.28.0" / "loop").symlink_to("series")
    with pytest.raises(SeriesError, match=r"^.*/series: a symbolic link that leads back to itself \(a loop\)"):
        Series.load(root / "0.28.0")
