"""Issue 53 causes 6 and 7: every parse guarded and its error line naming its source (the wheel and its line, the
flag, the profile), every number bounded where it is read."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from overlay import cli
from overlay import device as ds

REPO = Path(__file__).resolve().parent.parent
PROFILE = "glm5.2-nvfp4-tp8-dcp4-mtp5-a2a"


def _profile(tmp_path: Path, old: str, new: str) -> str:
    text = (REPO / "overlay" / "regress" / "profiles" / f"{PROFILE}.yaml").read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / "p.yaml"
    path.write_text(text.replace(old, new), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(("old", "new", "words"), [
    ('"num_speculative_tokens": 5', '"num_speculative_tokens": Infinity',
     "--speculative-config: not JSON (Infinity is not a number JSON allows)"),
    ('"num_speculative_tokens": 5', '"num_speculative_tokens": "5"',
     "--speculative-config num_speculative_tokens: must be an integer >= 0, got '5'"),
    ('"num_speculative_tokens": 5', '"num_speculative_tokens": -1', "must be an integer >= 0, got -1"),
    ('"num_speculative_tokens": 5', '"num_speculative_tokens": 1e999',
     "--speculative-config num_speculative_tokens: must be an integer >= 0, got inf"),
    ('{"method": "mtp", "num_speculative_tokens": 5}', '[1]', "--speculative-config: expected a JSON object"),
    ('--max-num-seqs, "128"', '--max-num-seqs, "nan"', "--max-num-seqs 'nan': not an integer"),
    ('--max-num-seqs, "128"', '--max-num-seqs, "1e20"', "--max-num-seqs '1e20': not an integer"),
])
def test_a_profile_number_workspace_plan_cannot_read_names_the_profile_and_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, words: str) -> None:
    """Cause 6: ``num_speculative_tokens: Infinity`` in a profile (traceback), ``--max-num-seqs nan`` (an error
    naming neither profile nor flag)."""
    path = _profile(tmp_path, old, new)
    rc = cli.main(["workspace-plan", "--profile", path])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    if "--max-num-seqs" not in words:  # refused where the profile is loaded (every verb that reads it): exit 2
        assert rc == 2 and err.startswith(f"error: {path}: server.args: --speculative-config")
    else:
        assert rc == 1 and err.startswith(f"error: --profile {path}: server.args: ")


def _wheel(tmp_path: Path, requires: str) -> Path:
    path = tmp_path / "vllm-0.28.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm-0.28.0.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: vllm\nVersion: 0.28.0\nRequires-Dist: {requires}\n\n")
    return path


def test_a_malformed_requires_dist_in_the_wheel_is_one_line(tmp_path: Path) -> None:
    """Cause 6: a ``--wheel`` whose METADATA holds a malformed ``Requires-Dist`` (a traceback from packaging)."""
    wheel = _wheel(tmp_path, "torch >>> 2")
    with pytest.raises(ds.DeviceStageError, match=rf"^{wheel}: METADATA: Requires-Dist 'torch >>> 2': not a "
                                                  r"requirement \(") as caught:
        ds.wheel_requires_dist(wheel)
    assert "\n" not in str(caught.value)
    assert ds.wheel_requires_dist(_wheel(tmp_path, "torch==2.11.0"))[1] == ["torch==2.11.0"]


def test_a_wheel_that_is_not_a_zip_is_one_line(tmp_path: Path) -> None:
    wheel = tmp_path / "x.whl"
    wheel.write_text("not a zip")
    with pytest.raises(ds.DeviceStageError, match=rf"^{wheel}: not a wheel with a METADATA"):
        ds.wheel_requires_dist(wheel)


@pytest.mark.parametrize("python", ["/bin/echo", "/bin/false"])
def test_a_resolver_python_that_is_not_one_is_named(python: str) -> None:
    """Cause 6: ``--resolver-python /bin/echo`` (a traceback unpacking what echo printed); ``/bin/false`` fell back to
    another Python without a word."""
    with pytest.raises(ds.DeviceStageError, match=rf"^--resolver-python {python}: not a Python with pip \(it "):
        ds.find_resolver(python)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv", [["--tp", "100000000000000000000"], ["--tp", "100000000000000000000", "--dcp", "3"],
                                  ["--num-heads", "100000000000000000000"]])
def test_workspace_plan_numbers_past_any_server_are_refused_at_once(capsys: pytest.CaptureFixture[str],
                                                                    argv: list[str]) -> None:
    """Cause 7: ``workspace-plan --tp 1e20`` (as digits) ran past a minute listing the divisors with a range (the
    timeout only keeps a regression from hanging the suite)."""
    assert cli.main(["workspace-plan", *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must be at most 2147483648, got 100000000000000000000" in err, err


def test_the_divisors_are_found_up_to_the_square_root() -> None:
    """Cause 7: the layout message's divisors, without a loop of ``tp`` steps."""
    from overlay.regress.workspace_plan import _divisors

    assert _divisors(12) == [1, 2, 3, 4, 6, 12] and _divisors(1) == [1]
    assert _divisors(2**31) == [2**i for i in range(32)]


@pytest.mark.parametrize("mib", ["0.000001", "0.5", "65", "1e9"])
def test_a_carry_limit_that_holds_nothing_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str],
                                                                   mib: str) -> None:
    """Cause 7: ``device-stage --limit-mib 0.000001`` exited 0 having staged nothing (and above 64 MiB a carry cannot
    travel in one device call)."""
    with pytest.raises(SystemExit) as caught:
        cli.main(["device-stage", "--limit-mib", mib])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "argument --limit-mib: expected MiB >= 1 and <= 64, got " + mib in err, err


def test_carries_with_no_room_are_refused_not_left_empty(tmp_path: Path) -> None:
    """Cause 7: the library says so too, for a limit that leaves no room beside the manifest."""
    from overlay.device.carries import write_carries
    from overlay.device.files import StagedFile

    source = tmp_path / "w.whl"
    source.write_bytes(b"x" * 100)
    staged = StagedFile("wheels/w.whl", "wheel", source, 100, "ab" * 32)
    with pytest.raises(ds.DeviceStageError, match=r"^carries of 3 bytes leave no room beside the manifest"):
        write_carries(tmp_path / "out", "engine", [staged], limit=3)
    assert not (tmp_path / "out").exists()
