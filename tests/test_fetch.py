from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from overlay.errors import FetchError
from overlay.fetch import fetch_wheel
from overlay.pins import Pin
from tests.wheelkit import make_wheel, sha256


@pytest.fixture
def good(tmp_path: Path) -> tuple[Pin, Path]:
    src = tmp_path / "src"
    src.mkdir()
    wheel = make_wheel(src, {"vllm/__init__.py": b""})
    return Pin("0.28.0", wheel.name, sha256(wheel)), wheel


def test_download_verified_and_cached(tmp_path: Path, good: tuple[Pin, Path]) -> None:
    pin, wheel = good
    calls: list[str] = []

    def downloader(req: str, dest: Path) -> None:
        calls.append(req)
        shutil.copy(wheel, dest / wheel.name)

    cache = tmp_path / "cache"
    got = fetch_wheel(pin, cache=cache, downloader=downloader)
    assert got == cache / "wheels" / pin.wheel and sha256(got) == pin.sha256
    assert fetch_wheel(pin, cache=cache, downloader=downloader) == got
    assert calls == ["vllm==0.28.0"]  # the second call used the cache


def test_mismatch_names_both_digests_and_keeps_nothing(tmp_path: Path, good: tuple[Pin, Path]) -> None:
    pin, wheel = good
    bad = Pin(pin.version, pin.wheel, "0" * 64)

    def downloader(req: str, dest: Path) -> None:
        shutil.copy(wheel, dest / wheel.name)

    cache = tmp_path / "cache"
    with pytest.raises(FetchError) as exc:
        fetch_wheel(bad, cache=cache, downloader=downloader)
    assert str(exc.value) == (
        f"{pin.wheel}: sha256 mismatch: expected {'0' * 64}, got {pin.sha256}"
    )
    assert list((cache / "wheels").iterdir()) == []  # the bad file is not kept


def test_corrupted_cache_entry_is_fetched_again(tmp_path: Path, good: tuple[Pin, Path]) -> None:
    pin, wheel = good
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / pin.wheel).write_bytes(b"truncated")

    def downloader(req: str, dest: Path) -> None:
        shutil.copy(wheel, dest / wheel.name)

    assert sha256(fetch_wheel(pin, cache=cache, downloader=downloader)) == pin.sha256


def test_download_without_the_expected_file(tmp_path: Path, good: tuple[Pin, Path]) -> None:
    pin, _ = good
    with pytest.raises(FetchError, match=r"pip did not produce vllm-0.28.0-.*\(got nothing\)"):
        fetch_wheel(pin, cache=tmp_path / "c", downloader=lambda req, dest: None)
