"""Issue 42 cause 1, *where the tool writes is not checked*: a cache root (``VLLM_OVERLAY_CACHE``) that is the
repository, lies inside it or above it (``/``), or an output name (``device-stage --name``) that leaves its
folder, is refused in one line before anything is written.

Each test's docstring says what the code did before.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from overlay.build.fetch import cache_dir
from overlay.cli import main
from overlay.errors import OverlayError

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("where", ["repository", "inside", "dot", "root", "above", "home"])
def test_a_cache_root_in_or_above_the_repository_is_refused(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """``VLLM_OVERLAY_CACHE=.`` (from the repository), the repository, a folder in it, ``/``, the folder holding
    the repository and the home folder itself: refused in one line naming the variable.

    Before: taken as they were: ``.`` put a 314 MB ``wheels/`` into the repository (the cache module's
    docstring says never inside it), ``/`` wrote ``/wheels/``, and the others wrote ``wheels/``, ``sdists/``,
    ``deps/`` and ``trees/`` beside a person's own folders.
    """
    monkeypatch.chdir(REPO)
    value = {"repository": str(REPO), "inside": str(REPO / "cache"), "dot": ".", "root": "/",
             "above": str(REPO.parent), "home": str(Path.home())}[where]
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", value)
    with pytest.raises(OverlayError) as exc:
        cache_dir()
    line = str(exc.value)
    assert exc.value.exit_code == 2 and "\n" not in line
    assert line.startswith(f"VLLM_OVERLAY_CACHE {value!r}: "), line
    assert "name a folder of its own" in line


def test_a_cache_root_that_is_a_link_loop_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Beside cause 1: ``VLLM_OVERLAY_CACHE`` a link loop is one line, not ``RuntimeError: Symlink loop``."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(tmp_path / "a"))
    with pytest.raises(OverlayError) as exc:
        cache_dir()
    assert str(exc.value) == (f"VLLM_OVERLAY_CACHE {str(tmp_path / 'a')!r}: a symbolic link that leads back to "
                              "itself (a loop): name a folder of its own (unset: ~/.cache/vllm-overlay)")


def test_a_cache_root_of_its_own_is_taken(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The check takes what a person means by a cache: a folder of its own anywhere else (unset: the
    default under the home folder)."""
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("VLLM_OVERLAY_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "vllm-overlay"


def test_a_build_with_the_cache_in_the_repository_writes_nothing_there(
    one_patch_release: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``VLLM_OVERLAY_CACHE=. make build`` in a checkout (here a stand-in checkout, so a failing run writes
    nowhere that matters): one line, exit 2, no ``wheels/`` in it, nothing downloaded.

    Before: the base wheel was downloaded into ``./wheels/`` of the repository and the build went on (exit 0).
    """
    root, wheel = one_patch_release
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.setattr("overlay.outpaths.REPO", checkout, raising=False)
    monkeypatch.chdir(checkout)
    monkeypatch.setenv("VLLM_OVERLAY_CACHE", ".")
    downloads: list[str] = []

    def download(requirement: str, dest: Path) -> None:
        downloads.append(requirement)
        shutil.copy(wheel, dest / wheel.name)

    monkeypatch.setattr("overlay.build.fetch.pip_download_wheel", download)
    rc = main(["--patches", str(root), "build", "--dist", str(tmp_path / "dist")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.splitlines() == [f"error: VLLM_OVERLAY_CACHE '.': {checkout} is the repository, and the tool writes "
                                "wheels/, sdists/, deps/, trees/ and more straight into it: name a folder of its own "
                                "(unset: ~/.cache/vllm-overlay)"]
    assert downloads == [] and list(checkout.iterdir()) == []


@pytest.mark.parametrize("name", ["../../x", "..", ".", "a/b", "/tmp/x"])
def test_a_device_stage_name_that_leaves_its_folder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str,
) -> None:
    """``overlay device-stage --name ../../x``: the parser refuses it (usage and one line naming ``--name``,
    exit 2), nothing written.

    Before: ``dest = Path(ns.dest) / ns.name`` built the stage outside ``.device/`` (``../../x`` two folders
    above it, ``/tmp/x`` anywhere).
    """
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["device-stage", "--name", name, "--wheel", str(tmp_path / "none.whl")])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.splitlines()[-1].startswith(f"overlay device-stage: error: argument --name: expected one folder name, "
                                           f"got {name!r}"), err
    assert list(tmp_path.iterdir()) == []
