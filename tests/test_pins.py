from __future__ import annotations

from pathlib import Path

import pytest

from overlay.build.pins import Pin, load_pin
from overlay.errors import PinError

REPO = Path(__file__).resolve().parent.parent


def test_real_pin() -> None:
    pin = load_pin(REPO / "patches", "0.28.0")
    assert pin.version == "0.28.0"
    assert pin.wheel == "vllm-0.28.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert pin.sha256 == "addb0ffdaafd8155d75e9b3f5ddb3da28fdee9e8a7097ede91f7db2e9e1a3889"
    assert Pin.from_dict(__import__("tomllib").loads(pin.to_toml()), "x") == pin


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    f = tmp_path / "pin.toml"
    f.write_text('version = "0.28"\nsha256 = "ABC"\ncolour = "red"\n')
    with pytest.raises(PinError) as exc:
        Pin.load(f)
    msg = str(exc.value)
    assert msg.startswith(f"{f}: ")
    for part in ("missing field 'wheel'", "unknown field(s) 'colour'", "not a release version: '0.28'",
                 "'sha256' is not 64 lowercase hex digits"):
        assert part in msg


def test_folder_and_version_must_agree(tmp_path: Path) -> None:
    d = tmp_path / "0.29.0"
    d.mkdir()
    (d / "pin.toml").write_text((REPO / "patches/0.28.0/pin.toml").read_text())
    with pytest.raises(PinError, match=r"field 'version' is '0\.28\.0' but the folder is '0\.29\.0'"):
        load_pin(tmp_path, "0.29.0")


def test_missing_pin(tmp_path: Path) -> None:
    with pytest.raises(PinError, match="no pin file"):
        load_pin(tmp_path, "0.30.0")


def test_bad_toml(tmp_path: Path) -> None:
    (tmp_path / "pin.toml").write_text("version = \n")
    with pytest.raises(PinError, match="not valid TOML"):
        Pin.load(tmp_path / "pin.toml")
