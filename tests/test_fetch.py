from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from overlay.build.fetch import fetch_wheel
from overlay.build.pins import Pin
from overlay.errors import FetchError
from tests.wheelkit import make_wheel, sha256


@pytest.fixture
def good(tmp_path: Path) -> tuple[Pin, Path]:
    src = tmp_path / "src"
    src.mkdir()
    wheel = make_wheel(src, {"vllm/__init__.py": b""})
    return Pin("0.28.0", wheel.name, sha256(wheel)), wheel


class Downloads:
    """A fake downloader that copies ``wheel`` (or fails, offline) and counts its calls."""

    def __init__(self, wheel: Path, *, offline: bool = False) -> None:
        self.wheel = wheel
        self.offline = offline
        self.calls: list[str] = []

    def __call__(self, req: str, dest: Path) -> None:
        self.calls.append(req)
        if self.offline:
            raise FetchError(f"pip download {req} failed (1): no network")
        shutil.copy(self.wheel, dest / self.wheel.name)


def test_download_verified_and_cached(tmp_path: Path, good: tuple[Pin, Path]) -> None:
    pin, wheel = good
    downloads = Downloads(wheel)
    cache = tmp_path / "cache"
    got = fetch_wheel(pin, cache=cache, downloader=downloads)
    assert got == cache / "wheels" / pin.wheel and sha256(got) == pin.sha256
    assert fetch_wheel(pin, cache=cache, downloader=downloads) == got
    assert downloads.calls == ["vllm==0.28.0"]  # the second call used the cache


def test_mismatching_download_is_kept_aside_and_not_downloaded_again(
    tmp_path: Path, good: tuple[Pin, Path]
) -> None:
    pin, wheel = good
    bad = Pin(pin.version, pin.wheel, "0" * 64)
    downloads = Downloads(wheel)
    cache = tmp_path / "cache"
    kept = cache / "quarantine" / "wheels" / pin.sha256 / pin.wheel
    with pytest.raises(FetchError) as exc:
        fetch_wheel(bad, cache=cache, downloader=downloads)
    assert str(exc.value) == (
        f"{pin.wheel}: sha256 mismatch: expected {'0' * 64}, got {pin.sha256}; the download is kept as {kept}: "
        f"if the sha256 in pin.toml is wrong, fix it (the next build takes the kept file); "
        f"if the download is damaged, delete {kept} to download it again"
    )
    assert list((cache / "wheels").iterdir()) == []  # nothing unverified enters the cache
    assert kept.read_bytes() == wheel.read_bytes()  # ... and nothing is destroyed
    with pytest.raises(FetchError, match=rf"^{kept}: sha256 mismatch: expected 0{{64}}, got {pin.sha256} "
                                         r"\(downloaded before and kept; not downloading it again\)"):
        fetch_wheel(bad, cache=cache, downloader=downloads)
    assert downloads.calls == ["vllm==0.28.0"]  # one download, not one per build
    # The pin is fixed: the kept file is verified and taken, without a download.
    assert fetch_wheel(pin, cache=cache, downloader=downloads) == cache / "wheels" / pin.wheel
    assert sha256(cache / "wheels" / pin.wheel) == pin.sha256 and not kept.exists()
    assert downloads.calls == ["vllm==0.28.0"]


@pytest.mark.parametrize("offline", [False, True], ids=["online", "offline"])
def test_pin_typo_keeps_the_cached_wheel_and_downloads_nothing(
    tmp_path: Path, good: tuple[Pin, Path], offline: bool
) -> None:
    """A typo in pin.toml's sha256 must not delete the valid cached wheel (issue: it did, then downloaded again)."""
    pin, wheel = good
    cache = tmp_path / "cache"
    fetch_wheel(pin, cache=cache, downloader=Downloads(wheel))
    cached = cache / "wheels" / pin.wheel
    typo = Pin(pin.version, pin.wheel, pin.sha256[:-1] + ("0" if pin.sha256[-1] != "0" else "1"))
    downloads = Downloads(wheel, offline=offline)
    for _ in range(2):
        with pytest.raises(FetchError) as exc:
            fetch_wheel(typo, cache=cache, downloader=downloads)
        assert str(exc.value) == (
            f"{cached}: sha256 mismatch: expected {typo.sha256}, got {pin.sha256}; the file is kept: "
            f"if the sha256 in pin.toml is wrong, fix it; if the file is damaged, delete it to download it again"
        )
    assert downloads.calls == []
    assert cached.read_bytes() == wheel.read_bytes()
    assert fetch_wheel(pin, cache=cache, downloader=downloads) == cached  # typo fixed: works at once, offline too


def test_corrupted_cache_entry_is_reported_not_replaced(tmp_path: Path, good: tuple[Pin, Path]) -> None:
    pin, wheel = good
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    cached = cache / "wheels" / pin.wheel
    cached.write_bytes(b"truncated")
    downloads = Downloads(wheel)
    with pytest.raises(FetchError, match=r"if the file is damaged, delete it to download it again$"):
        fetch_wheel(pin, cache=cache, downloader=downloads)
    assert cached.read_bytes() == b"truncated" and downloads.calls == []
    cached.unlink()  # what the message says to do
    assert sha256(fetch_wheel(pin, cache=cache, downloader=downloads)) == pin.sha256


def test_download_without_the_expected_file(tmp_path: Path, good: tuple[Pin, Path]) -> None:
    pin, _ = good
    with pytest.raises(FetchError, match=r"pip did not produce vllm-0.28.0-.*\(got nothing\)"):
        fetch_wheel(pin, cache=tmp_path / "c", downloader=lambda req, dest: None)


def test_every_digest_check_is_the_one_verify(
    tmp_path: Path, good: tuple[Pin, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35 item 3: a cached file, a fresh download, a file copied in and ``build --base-wheel`` are all
    checked by ``fetch.verify``, the one compare-and-raise step (one message, one place to change).

    Before: ``fetch_verified`` compared and raised twice inline (cache, download), ``copy_into_cache``
    called ``verify``, and ``--base-wheel`` was not checked at all: this saw one call of four.
    """
    import overlay.build.fetch as fetch
    import overlay.build.pipeline as pipeline
    from overlay.build.fetch import copy_into_cache
    from tests.wheelkit import BASE_FILES, good_patch, make_release

    pin, wheel = good
    real = fetch.verify
    seen: list[str] = []

    def spy(path: Path, expected: str, **kw: object) -> None:
        seen.append(Path(path).parent.name)
        real(path, expected, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(fetch, "verify", spy)
    monkeypatch.setattr(pipeline, "verify", spy, raising=False)
    cache = tmp_path / "cache"
    fetch_wheel(pin, cache=cache, downloader=Downloads(wheel))  # a download
    fetch_wheel(pin, cache=cache, downloader=Downloads(wheel))  # the cached file
    copy_into_cache(wheel, tmp_path / "copied", pin.sha256)  # a file copied in
    base = tmp_path / "given"
    base.mkdir()
    given = make_wheel(base, BASE_FILES)
    root = make_release(tmp_path / "rel", given, patches={"fix-a.patch": good_patch(tmp_path)})
    pipeline.build(root, "0.28.0", tmp_path / "dist", base_wheel=given)
    assert seen[:3] == [seen[0], "wheels", "src"] and seen[0].startswith(".download-")
    assert seen[3:] == ["given"]


REPO = Path(__file__).resolve().parent.parent
PINS = sorted([*REPO.glob("patches/*/pin.toml"), *REPO.glob("tests/pins/*/pin.toml")])


def pip_targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    """(platform, implementation, Python version) of each pip command ``fetch`` runs: the download and
    the index's digest of an unpinned release."""
    import subprocess

    import overlay.build.fetch as fetch

    seen: list[list[str]] = []

    def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[bytes]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, b"", b"")

    monkeypatch.setattr(fetch.subprocess, "run", run)
    with pytest.raises(FetchError):
        fetch.pip_download_wheel("vllm==0.28.0", tmp_path)
    with pytest.raises(FetchError):
        fetch.pip_index_digest("vllm==0.28.0")
    assert len(seen) == 2
    return [tuple(cmd[cmd.index(flag) + 1] for flag in ("--platform", "--implementation", "--python-version"))
            for cmd in seen]  # type: ignore[misc]


@pytest.mark.parametrize("pin_toml", PINS, ids=lambda p: str(p.relative_to(REPO).parent))
def test_every_pinned_wheel_is_one_pip_fetches_for_its_target(
    pin_toml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The platform and Python pip is told to fetch for (``fetch._PIP_TARGET``) and each pin's wheel file name
    had nothing linking them: a pin for another platform tag, or the target changed alone, and pip found
    no such wheel (``pip did not produce ...``) or another one."""
    from packaging.tags import cpython_tags
    from packaging.utils import parse_wheel_filename

    pin = Pin.load(pin_toml)
    name, version, _, tags = parse_wheel_filename(pin.wheel)
    assert (name, str(version)) == ("vllm", pin.version)
    assert PINS and any(p.parent.parent.name == "patches" for p in PINS)
    for platform, implementation, python in pip_targets(tmp_path, monkeypatch):
        major, minor = (int(n) for n in python.split("."))
        picks = set(cpython_tags((major, minor), platforms=[platform])) if implementation == "cp" else set()
        assert tags & picks, f"{pin_toml}: pip fetches for {implementation} {python} on {platform}, not {pin.wheel}"
