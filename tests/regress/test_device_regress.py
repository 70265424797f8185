"""scripts/device-regress.sh end to end on the CPU: the stand-in plays vLLM, the variants play the seed bugs.

The device script records the reference and baselines from the DCP 1 server, then runs three
``make regress`` at once against the series and two seed-bug variant trees and judges the
expected verdicts. Here a fake ``vllm`` starts the stand-in: ``healthy`` for the series and the
reference, ``skew`` (logprobs past 2048 tokens off) for the forced-MQA variant tree, ``dies``
(past a capacity) for the a2a-fallback variant tree, chosen by the tree first on PYTHONPATH, and
``bench serve`` writes vllm bench's result keys. Everything the device run depends on but vLLM
(the Makefile recipe, profile overrides, --record-baseline with two --baseline-for, the
differential reference file, lay_variant, the verdict judge) runs for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from regress_helpers import FIXTURE_GSM8K, REPO, STANDIN, free_port

from overlay.regress.verdicts import judge, parse_expectation

FAKE_VLLM = f"""
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
if args[0] == "bench":
    d = Path(args[args.index("--result-dir") + 1])
    (d / args[args.index("--result-filename") + 1]).write_text(json.dumps(
        {{"mean_ttft_ms": 40.0, "median_ttft_ms": 40.0, "mean_tpot_ms": 2.0, "median_tpot_ms": 2.0,
          "completed": 8, "num_prompts": 8}}))
    sys.exit(0)
assert args[0] == "serve", args
tree = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
mode = {{"minus-forced-mqa": "skew", "minus-a2a-fallback": "dies"}}.get(Path(tree).name, "healthy")
print("fake vllm:", mode, " ".join(args), flush=True)
os.execv(sys.executable, [sys.executable, {str(STANDIN)!r}, "--port", args[args.index("--port") + 1],
         "--model-name", args[args.index("--served-model-name") + 1], "--mode", mode,
         "--gsm8k", {str(FIXTURE_GSM8K)!r}, "--capacity", "5000", "--long-tokens", "2048"])
"""


def _variant_tar(path: Path) -> None:
    """A variant tarball as engine.variants writes it (files of vllm/ that the series touches)."""
    src = path.parent / (path.name + ".src") / "vllm" / "envs_variant_marker.py"
    src.parent.mkdir(parents=True)
    src.write_text("# variant\n")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src, arcname="vllm/envs_variant_marker.py")


@pytest.mark.timeout(600)
def test_device_regress_reaches_the_three_verdicts_with_the_standin(tmp_path: Path) -> None:
    pytest.importorskip("vllm")  # lay_variant lays the trees over the installed vLLM
    home = tmp_path / "home"
    model = home / ".cache" / "vllm-overlay" / "checkpoints" / "tiny-glm5-5afb0b361e5d"
    model.mkdir(parents=True)  # present: the script does not generate it
    variants = tmp_path / "variants"
    variants.mkdir()
    manifest = {}
    for variant in ("minus-dcp-forced-mqa-prefill-rows", "minus-dcp-direct-a2a-fallback"):
        _variant_tar(variants / f"{variant}.tar.gz")
        manifest[variant] = {"what": f"the series without {variant[len('minus-'):]}.patch"}
    (variants / "variants.json").write_text(json.dumps({"variants": manifest}))
    fake = tmp_path / "fake_vllm.py"
    fake.write_text(FAKE_VLLM)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bindir / "python3").chmod(0o755)
    root = tmp_path / "regress"
    port = free_port()
    env = {**os.environ, "HOME": str(home), "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
           "REGRESS_ROOT": str(root), "REGRESS_VLLM": f"{sys.executable} {fake}",
           "REGRESS_PORT_BASE": str(port), "OUT": str(tmp_path / "out"), "HF_DATASETS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)

    def stage(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "scripts/device-regress.sh", *args], cwd=REPO, env=env, text=True,
                              capture_output=True, timeout=280)

    ref = stage("reference")
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert (root / "ref-differential.json").is_file()
    for name in ("tiny-glm5-tp2-dcp2-mtp5", "tiny-glm5-tp2-dcp2-agrs-mtp5"):
        text = (root / "profiles" / f"{name}.yaml").read_text()
        assert f"name: {name}" in text and "recorded " in text and "mean_tpot_ms: 2.0" in text
    assert "--port" in (root / "ref" / "server.log").read_text()
    assert "vllm:spec_decode_num_drafts" in (root / "ref" / "metrics-after.txt").read_text()

    # One GPU lent: the reference profile at TP 1, the real formats kept and brought back.
    one = stage("one-gpu")
    assert one.returncode == 0, one.stderr[-3000:]
    assert "--tensor-parallel-size 1 " in (root / "one-gpu" / "server.log").read_text()
    assert "vllm:spec_decode_num_drafts" in (root / "one-gpu" / "metrics-after.txt").read_text()
    with tarfile.open(tmp_path / "out" / "regress-one-gpu.tar.gz") as tar:
        assert "./one-gpu/metrics-after.txt" in tar.getnames()

    # The verdicts on a fresh machine: the reference comes from what the reference stage brought back.
    env["REGRESS_ROOT"] = str(root := tmp_path / "fresh")
    with tarfile.open(tmp_path / "out" / "regress-reference-min.tar.gz") as tar:  # what is committed
        assert sorted(n for n in tar.getnames() if not n.startswith("./profiles/")) == [
            "./profiles", "./ref-differential.json"]
    env["REGRESS_REFERENCE"] = str(tmp_path / "out" / "regress-reference-min.tar.gz")
    run = stage("verdicts", str(variants))
    assert "reference and baselines from" in run.stderr
    summary = json.loads((root / "verdicts.json").read_text())
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    got = {o["name"]: (o["verdict"], o["met"]) for o in summary}
    assert got == {"series": ("pass", True), "minus-forced-mqa": ("regression", True),
                   "minus-a2a-fallback": ("regression", True)}
    assert "3 of 3 runs reached their expected verdict" in run.stdout
    assert (tmp_path / "out" / "verdicts.md").is_file() and (tmp_path / "out" / "regress-verdicts.tar.gz").is_file()
    # Each run had its own port; the variant servers ran on their trees.
    assert "skew" in (root / "minus-forced-mqa" / "server.log").read_text()
    assert "dies" in (root / "minus-a2a-fallback" / "server.log").read_text()


def test_the_verdict_judge_wants_the_right_reason() -> None:
    died = {"verdict": "regression", "reasons": ["differential: regression: server died: exited with status 1"]}
    diff = {"verdict": "regression", "reasons": ["differential: regression: prompt 2: logprob off by 1.5 nats"]}
    assert judge(*parse_expectation("a=regression:server-died"), died).met
    assert not judge(*parse_expectation("a=regression:server-died"), diff).met
    assert judge(*parse_expectation("a=regression:differential"), diff).met
    assert not judge(*parse_expectation("a=regression:differential"), died).met  # died is not a mismatch
    assert not judge(*parse_expectation("a=pass"), diff).met
    assert judge(*parse_expectation("a=pass"), {"verdict": "pass", "reasons": []}).met
    assert judge(*parse_expectation("a=pass"), None).why.startswith("no verdict.json")
    with pytest.raises(ValueError, match="'a=pass:x'"):
        parse_expectation("a=pass:x")
