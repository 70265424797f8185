"""Issue 53, the device staging's inputs (causes 2, 3, 5, 6, 7 and 8): what ``make device-stage`` reads decides
nothing about where it writes, nothing is read through a link out of the repository, every name and number is
checked where it is read, and each fault is one line naming its source."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from overlay import device as ds
from overlay.device import files
from tests.test_device_stage import StageRig, rig  # noqa: F401 (the fixture)

HOSTILE_WHEEL = {"name": "evil", "version": "1.0", "filename": "../../evil.whl", "url": "file:///etc/hostname",
                 "sha256": None}


def test_a_cached_resolution_naming_a_path_writes_nothing_outside_the_cache(rig: StageRig,  # noqa: F811
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Cause 2 (security): a resolution-cache entry whose ``filename`` is ``../../...`` with a ``file://`` URL and no
    sha256 made ``make device-stage`` write outside the cache (and the stage folder). Now the entry is not a
    resolution: a warning naming the file, resolved again, nothing written outside."""
    rig.stage()
    [cached] = rig.cache_files()
    doc = json.loads(cached.read_text())
    doc["wheels"] = [HOSTILE_WHEEL]
    cached.write_text(json.dumps(doc))
    capsys.readouterr()
    manifest = rig.stage()
    err = capsys.readouterr().err
    assert f"cached resolution {cached} unreadable" in err and "is not one name (it holds a /)" in err
    assert manifest["resolution"]["cached"] is False
    assert not (rig.tmp / "evil.whl").exists(), "written outside the cache"


@pytest.mark.parametrize(("field", "value", "words"), [
    ("filename", "../x.whl", "is not one name (it holds a /)"),
    ("filename", "..", "is not one name"),
    ("filename", "x.tar.gz", "is not a wheel's (*.whl)"),
    ("url", "ftp://h/x.whl", "is not https://, http:// or file://"),
    ("sha256", "../x", "is not 64 hex digits"),
])
def test_a_resolved_wheel_is_one_wheel_name(field: str, value: str, words: str) -> None:
    """Cause 2: the one check (``ResolvedWheel``), for the cache and pip's report alike."""
    fields = {"name": "x", "version": "1", "filename": "x-1-py3-none-any.whl", "url": "https://h/x.whl",
              "sha256": None, field: value}
    with pytest.raises(ValueError, match=rf"^x: its .*{words.replace('(', '.').replace(')', '.').replace('*', '.')}"):
        ds.ResolvedWheel(**fields)


def test_pips_report_naming_a_path_is_one_line() -> None:
    """Cause 2: a wheel URL whose last part is ``..`` in pip's report (an index's answer)."""
    report = {"install": [{"metadata": {"name": "x", "version": "1"},
                           "download_info": {"url": "https://h/a/..", "archive_info": {}}}]}
    with pytest.raises(ds.DeviceStageError, match=r"^pip's resolution: x: its file name '\.\.' is not one name"):
        ds.wheels_from_report(report)


def test_a_file_url_outside_the_sdist_builds_is_not_copied(tmp_path: Path) -> None:
    """Cause 2: a cached ``file://`` URL may name only a wheel the staging built (``device-wheels/from-sdist``);
    any other file of the machine is not copied into the stage."""
    secret = tmp_path / "secret.whl"
    secret.write_text("secret")
    wheel = ds.ResolvedWheel("x", "1", "x-1-py3-none-any.whl", f"file://{secret}", None)
    cache = tmp_path / "cache" / "device-wheels"
    with pytest.raises(ds.DeviceStageError, match=r"is not a wheel built from its sdist \(those are in .*from-sdist\)"):
        files.download_wheels([wheel], cache, ds.Resolver("python3", "x", True))
    assert not (cache / wheel.filename).exists()


def test_a_resolution_cache_file_that_links_out_is_not_read(rig: StageRig,  # noqa: F811
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Cause 2: the cache file itself a link to a file elsewhere (one a user of a shared cache can write)."""
    rig.stage()
    [cached] = rig.cache_files()
    elsewhere = rig.tmp / "elsewhere.json"
    elsewhere.write_text(cached.read_text())
    cached.unlink()
    cached.symlink_to(elsewhere)
    capsys.readouterr()
    assert rig.stage()["resolution"]["cached"] is False
    err = capsys.readouterr().err
    assert f"cached resolution {cached} unreadable (reached through a symbolic link out of" in err


@pytest.mark.parametrize("which", ["device-packages", "device-requires"])
@pytest.mark.parametrize("how", ["link-out", "link-loop"])
def test_a_device_record_that_links_out_is_refused_unread(tmp_path: Path, which: str, how: str) -> None:
    """Cause 3 (security): ``scripts/device-packages.txt`` (and ``device-requires.json``) a link to a file out of
    its folder was read and its first line quoted (``expected name==version, got 'hunter2'``)."""
    secret = tmp_path / "elsewhere" / "secret"
    secret.parent.mkdir()
    secret.write_text("hunter2\n")
    scripts = tmp_path / "repo" / "scripts"
    scripts.mkdir(parents=True)
    path = scripts / ("device-packages.txt" if which == "device-packages" else "device-requires.json")
    path.symlink_to(secret if how == "link-out" else path)
    with pytest.raises(ds.DeviceStageError) as caught:
        if which == "device-packages":
            ds.read_device_packages(path)
        else:
            ds.read_device_requires(path, {})
    line = str(caught.value)
    assert line.startswith(f"{path}: ") and "hunter2" not in line
    assert ("a loop" if how == "link-loop" else "reached through a symbolic link out of") in line


def test_the_repositorys_scripts_folder_is_the_bound(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Cause 3: inside the repository the bound is the repository (``scripts/`` itself a link out is refused)."""
    from overlay import outpaths

    repo = tmp_path / "repo"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "device-packages.txt").write_text("hunter2\n")
    repo.mkdir()
    (repo / "scripts").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setattr(outpaths, "REPO", repo)
    with pytest.raises(ds.DeviceStageError, match=r"scripts/device-packages.txt: reached through a symbolic link"):
        ds.read_device_packages(repo / "scripts" / "device-packages.txt")


def test_a_device_packages_file_that_is_a_device_is_refused(tmp_path: Path) -> None:
    """Cause 3: read bounded: a link to ``/dev/zero`` in its own folder's place (a FIFO, too) is not read."""
    path = tmp_path / "device-packages.txt"
    path.symlink_to("/dev/zero")
    with pytest.raises(ds.DeviceStageError, match="reached through a symbolic link out of"):
        ds.read_device_packages(path)
    (tmp_path / "sub").mkdir()
    fifo = tmp_path / "sub" / "device-packages.txt"
    import os

    os.mkfifo(fifo)
    with pytest.raises(ds.DeviceStageError, match="is a device, FIFO or socket, not a file"):
        ds.read_device_packages(fifo)


@pytest.mark.parametrize(("line", "words"), [
    ("../../evil==1.0", "'../../evil' is not a package name"),
    ("a/b==1.0", "'a/b' is not a package name"),
    ("-x==1.0", "'-x' is not a package name"),
    ("numpy==../../1", "'numpy': '../../1' is not a version"),
    ("numpy==1.0 junk", "'numpy': '1.0 junk' is not a version"),
])
def test_a_device_package_name_or_version_is_checked_where_it_is_read(tmp_path: Path, line: str, words: str) -> None:
    """Cause 5: ``../../evil==1.0`` in ``device-packages.txt`` ended in an error naming a temporary stub wheel;
    now the file and line are named."""
    path = tmp_path / "device-packages.txt"
    path.write_text(f"torch==2.11.0\n{line}\n")
    with pytest.raises(ds.DeviceStageError, match=rf"^{path}:2: {words.replace('(', '.').replace(')', '.')}"):
        ds.read_device_packages(path)


def test_a_stub_wheel_name_is_one_file_name(tmp_path: Path) -> None:
    """Cause 5: the stub's file name is checked where it is joined, too."""
    from overlay.device.resolve import write_stub_wheel

    with pytest.raises(ds.DeviceStageError, match=r"^\.\./\.\./evil==1\.0: not a package name and version"):
        write_stub_wheel(tmp_path / "stubs", "../../evil", "1.0")
    assert not list(tmp_path.rglob("*.whl"))


def test_the_repositorys_device_packages_all_read() -> None:
    """The guard: the device's own list passes the new checks."""
    repo = Path(__file__).resolve().parent.parent
    assert len(ds.read_device_packages(repo / "scripts" / "device-packages.txt")) > 100


def test_a_stage_folder_that_is_a_link_is_refused_before_anything_runs(rig: StageRig,  # noqa: F811
                                                                       tmp_path: Path) -> None:
    """Cause 8: the stage folder (``--dest``/``--name``) a symbolic link: a traceback from ``atomic.replacing_dir``
    (``rmtree`` of a link) after the whole resolution; now one line before it, nothing written through the link."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("mine")
    out = rig.tmp / "out" / "0.28.0+a"
    out.parent.mkdir()
    out.symlink_to(target)
    with pytest.raises(ds.DeviceStageError, match=rf"^{re.escape(str(out))}: is a symbolic link \(to "
                                                  rf"{re.escape(str(target))}\); the folder is replaced whole"):
        rig.stage()
    assert rig.resolves == 0 and [p.name for p in target.iterdir()] == ["keep"] and out.is_symlink()


def test_replacing_dir_refuses_a_link(tmp_path: Path) -> None:
    """Cause 8: at its cause, for every folder replaced whole (the stage, ``engine-checkpoint --out``)."""
    from overlay.atomic import replacing_dir
    from overlay.errors import OverlayError

    (tmp_path / "t").mkdir()
    (tmp_path / "d").symlink_to(tmp_path / "t")
    with pytest.raises(OverlayError, match="is a symbolic link"), replacing_dir(tmp_path / "d") as tmp:
        (tmp / "x").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "t"] and not list((tmp_path / "t").iterdir())
