"""Issue 25 item 20: ``make rebase`` stopped by SIGTERM early cleans up as SIGINT does, and a half-made
``.work/rebase-<to>`` (a git repository with no state file) is recognised and offered for removal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from overlay.git import git
from overlay.maintain.rebase import start
from overlay.maintain.rebase.release import continue_release
from overlay.maintain.rebase.state import RebaseError
from tests.rebasekit import BASE, FROM, TARGET, TARGET_PIN, TO, fill, make_patch, series_dir

REPO = Path(__file__).resolve().parent.parent


def _slow_rebase(tmp_path: Path, root: Path, work: Path, ready: Path) -> subprocess.Popen[str]:
    """A rebase in another process that fills the base tree, creates ``ready``, then sleeps (still preparing)."""
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from overlay.maintain.rebase import start
        from tests.rebasekit import BASE, FROM, TARGET, TARGET_PIN, fill

        def slow(dest: Path) -> None:
            fill(BASE)(dest)
            Path({str(ready)!r}).write_text("")
            time.sleep(60)

        start(Path({str(root)!r}), FROM, TARGET_PIN, slow, fill(TARGET), work=Path({str(work)!r}),
              tests_dir=Path({str(tmp_path / "no-tests")!r}))
    """)
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stderr=subprocess.PIPE, text=True)


def test_sigterm_while_preparing_removes_the_half_made_worktree(tmp_path: Path) -> None:
    """Issue 25 item 20: SIGTERM in the first seconds (the base tree being filled) left a git repo with no
    commit and no state file; now the worktree is removed, as on SIGINT."""
    root = tmp_path / "patches"
    series_dir(root, {"one.patch": make_patch(tmp_path, "one", {"vllm/a.py": BASE["vllm/a.py"] + "x = 1\n"})})
    work, ready = tmp_path / "work" / f"rebase-{TO}", tmp_path / "filling"
    proc = _slow_rebase(tmp_path, root, work, ready)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists() and (work / ".git").is_dir(), proc.stderr.read() if proc.poll() is not None else ""
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and not work.exists()


def test_a_half_made_worktree_is_recognised_and_offered_for_removal(tmp_path: Path) -> None:
    """Issue 25 item 20: ``make rebase`` said "in progress: make rebase-continue" and rebase-continue "no rebase
    in progress there"; both now say it stopped before it began and to remove it."""
    root = tmp_path / "patches"
    series_dir(root, {"one.patch": make_patch(tmp_path, "one", {"vllm/a.py": BASE["vllm/a.py"] + "x = 1\n"})})
    work_root = tmp_path / "work"
    work = work_root / f"rebase-{TO}"
    work.mkdir(parents=True)
    git(["init", "-q"], work)
    with pytest.raises(RebaseError) as exc:
        start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=work, tests_dir=tmp_path / "no-tests")
    assert str(exc.value) == (f"{work}: a rebase onto {TO} that stopped before it began (no .git/overlay-rebase.json): "
                              f"remove it (rm -rf {work}) and run make rebase again")
    with pytest.raises(RebaseError, match="stopped before it began; remove it and run make rebase again"):
        continue_release(work_root=work_root, run_tests=False)
    with pytest.raises(RebaseError, match=r"\(a rebase that stopped before it began: remove it"):
        continue_release(TO, work_root=work_root, run_tests=False)


def test_a_second_rebase_onto_the_same_release_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    """Issue 53 cause 9: two concurrent ``make rebase TO=0.34.0``: the second told the person to ``rm -rf`` the
    first one's live worktree (no state file yet: still preparing). Now the first holds
    ``.work/.rebase-<to>.lock`` while it runs; the second, and a continue, are refused naming the holder, and the
    live worktree is not offered for removal."""
    from overlay.lock import LockError

    root = tmp_path / "patches"
    series_dir(root, {"one.patch": make_patch(tmp_path, "one", {"vllm/a.py": BASE["vllm/a.py"] + "x = 1\n"})})
    work_root = tmp_path / "work"
    work, ready = work_root / f"rebase-{TO}", tmp_path / "filling"
    proc = _slow_rebase(tmp_path, root, work, ready)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), proc.stderr.read() if proc.poll() is not None else ""
        with pytest.raises(LockError) as second:
            start(root, FROM, TARGET_PIN, fill(BASE), fill(TARGET), work=work, tests_dir=tmp_path / "no-tests")
        line = str(second.value)
        assert line.startswith(f"{work}: a rebase onto {TO} is running there now: wait for it to stop (")
        assert f"is held by pid {proc.pid} on " in line and "rm -rf" not in line and "remove" not in line
        with pytest.raises(LockError, match="is running there now"):
            continue_release(TO, work_root=work_root, run_tests=False)
        with pytest.raises(RebaseError) as anyone:
            continue_release(work_root=work_root, run_tests=False)
        assert str(anyone.value) == f"no rebase in progress under {work_root}/"  # the live one not offered
        assert (work / ".git").is_dir()
    finally:
        proc.kill()
        proc.wait()
