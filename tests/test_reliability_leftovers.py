"""Issue 35 item 4, "leftovers of a killed run that no later run clears": a run SIGKILLed mid-download,
mid-workspace, mid-install of a release's test set or mid-cherry-pick (no ``finally`` runs) leaves no
child writing on, and the next run removes what it left and says so; a cherry-pick killed before its
conflict, or in its continue, is recognised by both verbs alike.

Every test kills a real child process with SIGKILL at a marked point (a fake ``pip`` on its
``PYTHONPATH``, or a step made slow in the child), then runs the next command in this process.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from overlay.atomic import write_file
from overlay.build.fetch import fetch_verified
from overlay.maintain.cherry_pick import CherryPickError, cherry_pick_continue
from overlay.maintain.workspace import create
from tests.killkit import gone, kill9_when, wait_for
from tests.rebasekit import FROM
from tests.wheelkit import format_patch, make_release, make_wheel, sha256

REPO = Path(__file__).resolve().parent.parent
LEFT_BY_KILLED = re.compile(r"cleanup: removed (\S+) \((\d+ MB|\d+ kB|\d+ bytes)\), left by a run that was killed "
                            r"\(pid (\d+), gone\)")

# A stand-in for pip (``python -m pip`` finds it first on PYTHONPATH): it records its pid, then writes
# into its destination (``-d`` or ``--target``) slowly, for at most 40 s, as a long download does.
FAKE_PIP = """\
import os, sys, time
from pathlib import Path
args = sys.argv[1:]
dest = Path(args[args.index("-d" if "-d" in args else "--target") + 1])
with (dest / "partial.whl").open("wb") as fh:
    Path(os.environ["FAKE_PIP_PID"]).write_text(str(os.getpid()))
    for _ in range(800):
        fh.write(b"x" * 65536)
        fh.flush()
        time.sleep(0.05)
"""


@pytest.fixture
def killed(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    """``killed(script, ready)``: run ``script`` in a child Python (this repository first on its path, the
    fake pip before that), SIGKILL it once ``ready`` exists; return the pid of the fake pip if one ran.
    Every fake pip still running is killed at teardown (on the code before the fix it outlived its parent)."""
    pip_dir = tmp_path / "fake-pip"
    (pip_dir / "pip").mkdir(parents=True)
    (pip_dir / "pip" / "__init__.py").write_text("")
    (pip_dir / "pip" / "__main__.py").write_text(FAKE_PIP)
    pid_file = tmp_path / "fake-pip.pid"
    left: list[int] = []

    def run(script: str, ready: Path) -> int | None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pip_dir), str(REPO)]),
               "FAKE_PIP_PID": str(pid_file)}
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=env,
                                stderr=subprocess.PIPE, text=True)
        kill9_when(proc, ready.exists, "the child never got ready")
        if pid_file.exists():
            left.append(int(pid_file.read_text()))
            return left[-1]
        return None

    yield run
    for pid in left:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


# --- the owned temporaries themselves ---------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_processs_temporary_is_never_removed(tmp_path: Path) -> None:
    """Issue 35 item 4 (leftovers): a sweep takes only what a gone process left: not a live one's folder,
    not one whose pid is gone but whose lock is held (a process of another PID namespace with this host
    name), not another machine's, not a link named like one, not a name of no owner."""
    from overlay.atomic import host, sweep, temp_dir

    parent = tmp_path / "cache"
    parent.mkdir()
    script = f"""
        import time
        from pathlib import Path
        from overlay.atomic import temp_dir
        with temp_dir(Path({str(parent)!r}), ".download-") as tmp:
            (tmp / "part").write_text("x")
            time.sleep(60)
    """
    live = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO)
    try:
        assert wait_for(lambda: any(p.glob("part") for p in parent.glob(".download-*")), 30)
        [live_dir] = parent.glob(".download-*")
        dead = _dead_pid()
        locked = parent / f".download-{host()}-{dead}-abcdefgh"
        locked.mkdir()
        fd = os.open(locked, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held, as by its (live) owner in another PID namespace
        other = parent / f".download-other-machine-{dead}-abcdefgh"
        other.mkdir()
        target = tmp_path / "precious"
        target.mkdir()
        (parent / f".download-{host()}-{dead}-zzzzzzzz").symlink_to(target)
        (parent / ".download-mine").mkdir()
        assert sweep(parent, ".download-") == []
        with temp_dir(parent, ".download-"):
            pass
        assert live_dir.is_dir() and locked.is_dir() and other.is_dir() and target.is_dir()
        assert (parent / ".download-mine").is_dir()
        os.close(fd)
        assert sweep(parent, ".download-") == [locked]  # its lock released: the owner is gone
    finally:
        live.kill()
        live.wait()
    assert sweep(parent, ".download-") == [live_dir]  # killed: its pid gone, its lock dropped


def test_an_older_tools_temporary_goes_only_after_a_quiet_day(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35 item 4 (leftovers): ``.download-<8 random>`` (the tool before owned names) records no owner:
    it is removed once nothing in it changed for a day, never while anything in it is newer."""
    from overlay.atomic import LEGACY_QUIET_S, sweep

    parent = tmp_path / "wheels"
    old = parent / ".download-k2j4h5g6"
    (old / "deep").mkdir(parents=True)
    (old / "deep" / "f.whl").write_bytes(b"x" * 2048)
    day_ago = time.time() - LEGACY_QUIET_S - 60
    for p in (old / "deep" / "f.whl", old / "deep", old):
        os.utime(p, (day_ago, day_ago))
    busy = parent / ".download-a1b2c3d4"
    (busy / "deep").mkdir(parents=True)
    (busy / "deep" / "f.whl").write_bytes(b"x")  # written now, though its folders look old
    for p in (busy / "deep", busy):
        os.utime(p, (day_ago, day_ago))
    assert sweep(parent, ".download-") == [old]
    assert busy.is_dir()
    assert f"cleanup: removed {old} (2 kB), left by an earlier run (an older tool's name; nothing in it changed " \
           "for a day)" in capsys.readouterr().err


def test_a_killed_write_file_leaves_nothing_the_next_write_keeps(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35 item 4 (leftovers): ``write_file`` (reports, series, state files) killed mid-write left
    ``.<name>.<random>.tmp`` forever; the next write of that file removes a dead writer's."""
    dest = tmp_path / "report" / "report.json"
    script = f"""
        import os, signal
        from pathlib import Path
        import overlay.atomic as atomic
        def killed(path, mode):
            os.kill(os.getpid(), signal.SIGKILL)
        atomic.os.chmod = killed
        atomic.write_file(Path({str(dest)!r}), "{{}}")
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, check=False)
    assert proc.returncode == -signal.SIGKILL
    [left] = [p for p in dest.parent.iterdir() if p.name != "report.json"]
    write_file(dest, "{}")
    assert sorted(p.name for p in dest.parent.iterdir()) == ["report.json"]
    assert f"cleanup: removed {left} " in capsys.readouterr().err


# --- the run's own leftovers ----------------------------------------------------------------------------


def test_a_killed_download_leaves_no_pip_writing_and_the_next_fetch_removes_its_folder(
        tmp_path: Path, killed, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """Issue 35 item 4 (leftovers): a SIGKILLed download left its pip child writing and 314 MB in
    ``wheels/.download-*``. Now pip dies with the run, and the next fetch removes the folder, saying so."""
    src = tmp_path / "src"
    src.mkdir()
    wheel = make_wheel(src, {"vllm/__init__.py": b""})
    cache = tmp_path / "cache"
    ready = tmp_path / "fake-pip.pid"
    pip = killed(f"""
        from pathlib import Path
        from overlay.build.fetch import fetch_wheel
        from overlay.build.pins import Pin
        fetch_wheel(Pin("0.28.0", {wheel.name!r}, {sha256(wheel)!r}), cache=Path({str(cache)!r}))
    """, ready)
    assert pip is not None
    assert wait_for(lambda: gone(pip), 10), "pip went on writing after its parent was killed"
    [left] = (cache / "wheels").glob(".download-*")
    assert (left / "partial.whl").is_file()
    got = fetch_verified(cache / "wheels", wheel.name, sha256(wheel),
                         lambda dest: (dest / wheel.name).write_bytes(wheel.read_bytes()))
    assert got.read_bytes() == wheel.read_bytes()
    assert sorted(p.name for p in (cache / "wheels").iterdir()) == [wheel.name]
    m = LEFT_BY_KILLED.search(capsys.readouterr().err)
    assert m is not None and m[1] == str(left)


def test_a_killed_workspace_leaves_nothing_the_next_one_keeps(tmp_path: Path, killed,  # type: ignore[no-untyped-def]
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35 item 4 (leftovers): a killed ``make workspace`` left its half-made tree (132 MB for
    0.28.0) beside ``.work/0.28.0`` for good; the next ``make workspace`` removes it and says so."""
    base = tmp_path / "base"
    base.mkdir()
    a = b"".join(f"a{i} = {i}\n".encode() for i in range(20))
    wheel = make_wheel(base, {"vllm/a.py": a})
    patch = format_patch({"vllm/a.py": a}, {"vllm/a.py": a.replace(b"a3 = 3", b"a3 = 33")}, "Fix", work=tmp_path)
    root = make_release(tmp_path, wheel, patches={"fix.patch": patch})
    work, ready = tmp_path / ".work", tmp_path / "extracted"
    work.mkdir()  # as it is once anything ran (the tool before made the tree in /tmp without it)
    killed(f"""
        import time
        from pathlib import Path
        import overlay.maintain.workspace as ws
        real = ws.extract_text_tree
        def slow(wheel, dest):
            real(wheel, dest)
            Path({str(ready)!r}).write_text("")
            time.sleep(60)
        ws.extract_text_tree = slow
        ws.create(Path({str(root)!r}), "0.28.0", Path({str(work / "0.28.0")!r}), base_wheel=Path({str(wheel)!r}))
    """, ready)
    [left] = list(work.iterdir())
    assert (left / "vllm" / "a.py").is_file() and not (work / "0.28.0").exists()
    create(root, "0.28.0", work / "0.28.0", base_wheel=wheel)
    assert [p.name for p in work.iterdir()] == ["0.28.0"]
    m = LEFT_BY_KILLED.search(capsys.readouterr().err)
    assert m is not None and m[1] == str(left)


def test_a_killed_install_of_a_releases_test_set_is_removed_by_the_next(
        tmp_path: Path, killed, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """Issue 35 item 4 (leftovers): a rebase killed while pip installs a release's whole dependency set
    (3.9 GB for 0.28.0) left pip writing and the half-made folder in ``<cache>/deps/``; now pip dies
    with it and the next run removes the folder."""
    from overlay.maintain.rebase.deps import MAKE_LOCK, Torch, release_deps

    (tmp_path / "w").mkdir()
    wheel = make_wheel(tmp_path / "w", {"vllm/__init__.py": b""}, "9.9.0")
    cache = tmp_path / "cache"
    pip = killed(f"""
        from pathlib import Path
        from overlay.maintain.rebase.deps import Torch, release_deps
        release_deps("9.9.0", Path({str(wheel)!r}), cache=Path({str(cache)!r}), resolver=lambda reqs: ["x==1"],
                     torch=Torch("2.13.0+cpu", (), ()))
    """, tmp_path / "fake-pip.pid")
    assert pip is not None and wait_for(lambda: gone(pip), 10), "pip went on installing after its parent was killed"
    [left] = [p for p in (cache / "deps").iterdir() if p.name != MAKE_LOCK]
    assert left.name.startswith(".")

    def install(pins: list[str], dest: Path) -> None:
        (dest / "x.py").write_text("")

    done = release_deps("9.9.0", wheel, cache=cache, resolver=lambda reqs: ["x==1"], installer=install,
                        torch=Torch("2.13.0+cpu", (), ()))
    assert [p.name for p in (cache / "deps").iterdir() if p.name != MAKE_LOCK] == [done.name]
    m = LEFT_BY_KILLED.search(capsys.readouterr().err)
    assert m is not None and m[1] == str(left)


# A stand-in for pip that makes its own temporary folder as pip does (``pip-unpack-*`` under ``$TMPDIR``, where a
# download lands before it is moved), records its pid, then either sleeps (to be killed) or, with FAKE_PIP_WHEEL,
# puts that wheel into ``-d`` and removes its temporary folder, as a pip that finishes does.
FAKE_PIP_TEMP = """\
import os, shutil, sys, tempfile, time
from pathlib import Path
args = sys.argv[1:]
unpack = Path(tempfile.mkdtemp(prefix="pip-unpack-"))
(unpack / "vllm.whl").write_bytes(b"x" * 65536)
Path(os.environ["FAKE_PIP_PID"]).write_text(str(os.getpid()))
if os.environ.get("FAKE_PIP_WHEEL"):
    shutil.copy(os.environ["FAKE_PIP_WHEEL"], args[args.index("-d") + 1])
    shutil.rmtree(unpack)
    sys.exit(0)
time.sleep(40)
"""


def test_a_killed_downloads_pip_temporaries_are_removed_by_the_next_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 42 cause 3: a ``make build`` killed while pip downloaded left pip's own ``$TMPDIR/pip-unpack-*``
    (300 MB) after the next ``make build`` (a killed install: empty ``$TMPDIR/pip-*``): the sweep removed the
    tool's temporaries, not those pip made for itself. Now pip runs with ``TMPDIR`` an owned folder of the
    tool's (``overlay.atomic.child_tmpdir``), so the next run that starts pip removes it, pip's inside."""
    src = tmp_path / "src"
    src.mkdir()
    wheel = make_wheel(src, {"vllm/__init__.py": b""})
    fake = tmp_path / "fake-pip"
    (fake / "pip").mkdir(parents=True)
    (fake / "pip" / "__init__.py").write_text("")
    (fake / "pip" / "__main__.py").write_text(FAKE_PIP_TEMP)
    tmp, cache, pid_file = tmp_path / "tmp", tmp_path / "cache", tmp_path / "fake-pip.pid"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(REPO)]), "FAKE_PIP_PID": str(pid_file),
           "TMPDIR": str(tmp)}
    fetch = f"""
        from pathlib import Path
        from overlay.build.fetch import fetch_wheel
        from overlay.build.pins import Pin
        fetch_wheel(Pin("0.28.0", {wheel.name!r}, {sha256(wheel)!r}), cache=Path({str(cache)!r}))
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(fetch)], cwd=REPO, env=env,
                            stderr=subprocess.PIPE, text=True)
    kill9_when(proc, pid_file.exists, "the fake pip never started")
    pip = int(pid_file.read_text())
    try:
        assert wait_for(lambda: gone(pip), 10), "pip went on after its parent was killed"
    finally:
        if not gone(pip):
            os.kill(pip, signal.SIGKILL)
    [unpack] = tmp.rglob("pip-unpack-*")
    for name, value in {**env, "FAKE_PIP_WHEEL": str(wheel)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    pid_file.unlink()
    from overlay.build.fetch import fetch_wheel
    from overlay.build.pins import Pin

    got = fetch_wheel(Pin("0.28.0", wheel.name, sha256(wheel)), cache=cache)
    assert got.read_bytes() == wheel.read_bytes() and pid_file.exists()  # the next run's pip ran
    assert list(tmp.rglob("pip-*")) == [], f"{unpack} was left"
    assert list(tmp.iterdir()) == []
    removed = [Path(m[1]) for m in LEFT_BY_KILLED.finditer(capsys.readouterr().err)]
    assert any(r in unpack.parents for r in removed), removed


def test_every_pip_the_tool_starts_gets_an_owned_temporary_folder() -> None:
    """Issue 42 cause 3, a guard: every module that starts pip (``-m pip``) gives it ``TMPDIR`` through
    ``overlay.atomic.child_tmpdir``, so what a killed pip leaves there is swept by the next run."""
    found = []
    for path in sorted((REPO / "overlay").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        text = path.read_text()
        if re.search(r'"-m",\s*"pip"', text) and "child_tmpdir(" not in text:
            found.append(rel)
    assert found == []


def test_every_temporary_under_the_tools_folders_is_an_owned_one() -> None:
    """Issue 35 item 4 (leftovers), a guard: a temporary folder or file is made only through
    ``overlay.atomic`` (``temp_dir``, ``temp_file``, ``scratch``, ``write_file``), so the next run can tell
    a killed run's from a live one's; ``dist/``'s wheel file (``distdir``, owned the same way under the
    build lock) and the probe of an output folder (removed in the same breath) are the two others."""
    allowed = {"overlay/atomic.py", "overlay/build/distdir.py", "overlay/outpaths.py"}
    found = []
    for path in sorted((REPO / "overlay").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        text = path.read_text()
        for m in re.finditer(r"tempfile\.(mkdtemp|mkstemp|TemporaryDirectory|NamedTemporaryFile)\(", text):
            if rel not in allowed:
                found.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: tempfile.{m[1]}")
    assert found == []


# --- a killed cherry-pick ----------------------------------------------------------------------------------


@pytest.fixture
def pick_setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    from tests.rebasekit import lines, make_patch, series_dir
    from tests.test_cherry_pick import upstream_remote

    root = tmp_path / "patches"
    series_dir(root, {"a.patch": make_patch(tmp_path, "a", {"vllm/a.py": lines("a", 40, l35="a_35 = 'ours'")})})
    remote, _ = upstream_remote(tmp_path)
    return root, remote, tmp_path / "work" / f"cherry-pick-{FROM}"


def _pick(root: Path, remote: Path, work: Path, ref: str):  # type: ignore[no-untyped-def]
    from overlay.maintain.cherry_pick import cherry_pick
    from tests.rebasekit import BASE, fill

    return cherry_pick(root, FROM, ref, fill_base=fill(BASE), work=work, remote=str(remote), today="2026-12-01")


def test_a_cherry_pick_killed_before_its_conflict_is_cleared_by_the_next_pick(
        tmp_path: Path, pick_setup, killed, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """Issue 35 item 4 (leftovers): after a SIGKILLed ``make cherry-pick``, ``cherry-pick`` said "in progress:
    make cherry-pick-continue" and ``cherry-pick-continue`` "no cherry-pick in progress there". Now the
    state is written only at a conflict: continue says the pick was killed before one and that
    ``make cherry-pick`` starts again, and that pick removes the tree (saying so) and succeeds."""
    root, remote, work = pick_setup
    ready = tmp_path / "filled"
    killed(f"""
        import time
        from pathlib import Path
        from overlay.maintain.cherry_pick import cherry_pick
        from tests.rebasekit import BASE, fill
        def slow(dest):
            fill(BASE)(dest)
            Path({str(ready)!r}).write_text("")
            time.sleep(60)
        cherry_pick(Path({str(root)!r}), {FROM!r}, "7", fill_base=slow, work=Path({str(work)!r}),
                    remote={str(remote)!r}, today="2026-12-01")
    """, ready)
    assert (work / "vllm" / "a.py").is_file()
    with pytest.raises(CherryPickError) as exc:
        cherry_pick_continue(work)
    assert str(exc.value) == (f"{work}: left by a cherry-pick that was killed before it reached a conflict: "
                              "nothing to continue; `make cherry-pick REF=...` removes it and starts again")
    out = _pick(root, remote, work, "7")
    assert out.done and not work.exists()
    assert (f"cherry-pick: removing {work}, left by a cherry-pick that was killed before it reached a conflict "
            "(nothing in it to continue)") in capsys.readouterr().err


def test_a_killed_cherry_pick_continue_is_run_again_as_it_is(tmp_path: Path, pick_setup, killed) -> None:  # type: ignore[no-untyped-def]
    """Issue 35 item 4 (leftovers): a ``cherry-pick-continue`` killed after its commit left a tree that
    every later continue refused (git: nothing to commit); now a continue first puts the tree back to the
    resolved conflict, and finishes."""
    from tests.rebasekit import lines

    root, remote, work = pick_setup
    out = _pick(root, remote, work, "8")
    assert not out.done
    (work / "vllm" / "a.py").write_text(lines("a", 40, l35="a_35 = 'ours and upstream'"))
    subprocess.run(["git", "-C", str(work), "add", "vllm/a.py"], check=True)
    ready = tmp_path / "committed"
    killed(f"""
        import time
        from pathlib import Path
        import overlay.maintain.cherry_pick as cp
        real = cp.format_patch
        def slow(repo, rev):
            raw = real(repo, rev)
            Path({str(ready)!r}).write_text("")
            time.sleep(60)
        cp.format_patch = slow
        cp.cherry_pick_continue(Path({str(work)!r}))
    """, ready)
    done = cherry_pick_continue(work)
    assert done.done and not work.exists()
    series = (root / FROM / "series").read_text().splitlines()
    assert [n for n in series if not n.startswith("#")] == ["a.patch", "fix-a-35.patch"]
    assert "a_35 = 'ours and upstream'" in (root / FROM / "fix-a-35.patch").read_text()


def test_a_continue_killed_after_it_wrote_the_series_only_removes_the_tree(tmp_path: Path, pick_setup) -> None:  # type: ignore[no-untyped-def]
    """Issue 35 item 4 (leftovers): killed between writing the series and removing its tree, a continue left
    a state whose patch is in the series already; the next continue says so and removes the tree instead
    of adding the patch twice."""
    root, remote, work = pick_setup
    out = _pick(root, remote, work, "8")
    assert not out.done
    state = json.loads((work / ".git" / "overlay-cherry-pick.json").read_text())
    series = root / FROM / "series"
    series.write_text(series.read_text() + f"{state['name']}\n")
    (root / FROM / state["name"]).write_bytes((root / FROM / "a.patch").read_bytes())  # as the run wrote it
    done = cherry_pick_continue(work)
    assert done.done and not work.exists()
    assert done.message == f"{state['name']} was added already (a continue killed before it removed {work})"
    assert series.read_text().count(state["name"]) == 1
