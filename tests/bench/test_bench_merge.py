"""``make bench-merge VLLM=<release>`` times the build of that release, or says in one line why it cannot."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

from overlay.build.install import installed_mismatch
from overlay.build.pins import carried_releases

REPO = Path(__file__).resolve().parents[2]


def test_the_installed_build_must_be_the_named_release() -> None:
    have = version("vllm")
    mine = have.split("+", 1)[0]
    assert installed_mismatch(None) is None
    assert installed_mismatch(mine) is None
    for other in (r for r in carried_releases(REPO / "patches") if r != mine):
        assert installed_mismatch(other) == (f"--vllm {other}: the installed vLLM is {have}; install {other}'s "
                                             f"build (make build VLLM={other})")


def test_the_command_refuses_another_release_before_any_gpu(tmp_path: Path, capsys) -> None:
    from overlay.cli import main

    other = next(r for r in carried_releases(REPO / "patches") if r != version("vllm").split("+", 1)[0])
    assert main(["bench-merge", "--vllm", other, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"bench-merge: --vllm {other}: the installed vLLM is ") and len(err.splitlines()) == 1

