"""The two-GPU cases of the vLLM 0.33.0 build (issue 34 item 4), on CPU with the run_case stand-in, and
that a build's cases follow its release facts (issue 41 item 3), never its version string.

vLLM 0.33.0 resolves the DCP options a GLM-5 user leaves unset to the a2a combine with query
replication; our regress profiles name the comm backend and leave query replication to the release.
The 0.33.0 build's cases run TP2 x DCP2 with nothing set, with the profiles' explicit settings and
with the query all-gather named, each against its DCP 1 reference and judged on what the engine
resolved. Here: what each case hands the engine, that the settings are our profiles' and the
release's, and that the check's machinery (jobs, judge, report) runs and judges them, with
``tests/engine/fake_run_case.py`` in place of the engine. The facts are those of a synthetic tree shaped
like each release (``tests/factskit.py``; ``tests/test_release_facts.py`` holds each shape to the real tree).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from overlay.engine import check, verdict
from overlay.engine.workload import PROFILE_SETTINGS, cases, release_cases, runner_cases
from overlay.releases.projection import ARGUMENT, value_of_env
from tests import factskit

FACTS = factskit.facts("0.33.0")

REPO = Path(__file__).resolve().parents[2]
OWN = ["dcp-defaults-graph-mtp", "dcp-a2a-direct-proj1-qgather-graph-mtp", "dcp-defaults-graph",
       "dcp-defaults-proj0-graph-mtp", "dcp-agrs-proj1-qgather-graph-mtp", "dcp-defaults-proj1-graph-mtp"]
RUNNERS = ["ref-dcp1-v1", "ref-dcp1-mtp-v1"]


def test_the_0_33_0_build_runs_its_own_cases_first_after_the_references() -> None:
    names = [c.name for c in cases(2, FACTS)]
    assert names[:5] == ["ref-dcp1", "ref-dcp1-mtp", "dcp-defaults-graph-mtp", "ref-dcp1-reordered",
                         "dcp-a2a-direct-proj1-graph-mtp"]  # then our profile's production shape
    assert [c.name for c in release_cases(FACTS)] == OWN and set(OWN) <= set(names)
    assert len(names) == len(set(names))
    assert [c.name for c in cases(2)] == [c.name for c in cases(2, factskit.facts("0.28.0"))]  # 0.28.0's, as it was
    assert {c.name for c in cases(2, FACTS)} - set(OWN) - set(RUNNERS) - {"dcp-defaults-graph-mtp-sweep"} == {
        c.name for c in cases(2)}
    assert release_cases(FACTS, tp=1) == []
    assert [c.name for c in cases(1, FACTS)] == ["ref-dcp1", "ref-dcp1-mtp", *RUNNERS, "ref-dcp1-rerun",
                                                    "ref-dcp1-reordered", "ref-dcp1-mtp-eager"]


def test_a_v2_runner_release_runs_dcp1_under_v1_too() -> None:
    """0.33.0 defaults to Model Runner V2; the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0), where
    spec-decode-prompt-logprobs-graph-pool applies, runs the plain reference again (judged against
    ref-dcp1: the runners must agree) and MTP against that plain V1 run, each on the runner it
    resolved; 0.28.0 (V1 only) has no such cases."""
    assert runner_cases(factskit.facts("0.28.0")) == [] and runner_cases(None) == []
    for tp in (1, 2):
        by = {c.name: c for c in cases(tp, FACTS)}
        for name in RUNNERS:
            c = by[name]
            assert c.env == {"VLLM_USE_V2_MODEL_RUNNER": "0"} and c.resolves == {"use_v2_model_runner": False}
            assert c.dcp == 1 and c.tp == tp and c.release == "0.33.0"
        assert (by["ref-dcp1-v1"].role, by["ref-dcp1-v1"].compare_to) == ("reference", "")
        assert (by["ref-dcp1-mtp-v1"].role, by["ref-dcp1-mtp-v1"].compare_to) == ("check", "ref-dcp1-v1")
        assert by["ref-dcp1-mtp-v1"].mtp and by["ref-dcp1-mtp-v1"].graphs == "FULL" and not by["ref-dcp1-v1"].mtp
        assert by["ref-dcp1-mtp"].resolves == {"use_v2_model_runner": True} and by["ref-dcp1-mtp"].env == {}
        assert by["ref-dcp1"].resolves == {} and by["ref-dcp1"].env == {}
    assert all(not c.resolves for c in cases(1))  # 0.28.0: nothing to resolve at DCP 1


def test_what_each_case_hands_the_engine() -> None:
    by = {c.name: c for c in cases(2, FACTS)}
    defaults = by["dcp-defaults-graph-mtp"].engine_kwargs("/m")
    assert defaults["decode_context_parallel_size"] == 2 and defaults["tensor_parallel_size"] == 2
    assert "dcp_comm_backend" not in defaults and "dcp_q_replicate" not in defaults  # the release decides
    assert defaults["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 5}
    assert by["dcp-defaults-graph-mtp"].env == {}  # our build's own defaults too (project-before-merge on)
    qgather = by["dcp-a2a-direct-proj1-qgather-graph-mtp"].engine_kwargs("/m")
    assert (qgather["dcp_comm_backend"], qgather["dcp_q_replicate"]) == ("a2a", False)
    profile = by["dcp-a2a-direct-proj1-graph-mtp"].engine_kwargs("/m")
    assert profile["dcp_comm_backend"] == "a2a" and "dcp_q_replicate" not in profile
    assert (by["dcp-defaults-proj0-graph-mtp"].env, by["dcp-defaults-proj0-graph-mtp"].projection) == ({}, "off")
    assert (by["dcp-defaults-proj1-graph-mtp"].env, by["dcp-defaults-proj1-graph-mtp"].projection) == ({}, "on")
    assert by["dcp-defaults-graph-mtp"].projection == ""  # the release's own


def test_every_dcp_case_of_the_build_is_judged_on_what_it_resolved_and_against_dcp1() -> None:
    qrep = FACTS.dcp_q_replicate
    names = {c.name for c in cases(2, FACTS)}
    for c in cases(2, FACTS):
        if c.dcp == 1:  # judged on the model runner only (test_a_v2_runner_release_runs_dcp1_under_v1_too)
            assert set(c.resolves) <= {"use_v2_model_runner"}, c.name
            continue
        assert c.release == "0.33.0"
        assert c.resolves["dcp_comm_backend"] == (c.backend or FACTS.dcp_comm_backend)
        assert c.resolves["dcp_q_replicate"] == (qrep if c.q_replicate is None else c.q_replicate), c.name
        assert (c.compare_to or "ref-dcp1") in names  # its DCP 1 reference runs in the same check
        if c.mtp and not c.eager and c.interleave == 1:
            assert c.graphs == "FULL" and c.compare_to.startswith("ref-dcp1-mtp")


def test_round_trip_through_the_case_file() -> None:
    from overlay.engine.workload import Case

    for c in cases(2, FACTS):
        d = json.loads(json.dumps(c.to_dict()))
        assert Case(**{k: tuple(v) if k == "prompt_lens" else v for k, v in d.items()}) == c  # as run_case reads it
    assert all("resolves" not in c.to_dict() and "release" not in c.to_dict() for c in cases(2))


def test_the_profile_settings_are_the_profiles() -> None:
    """PROFILE_SETTINGS say what the shipped profiles say: the comm backend and the projection in their
    arguments, no query replication there, the rest in their environment."""
    yaml = pytest.importorskip("yaml")
    for name, settings in PROFILE_SETTINGS.items():
        doc = yaml.safe_load((REPO / "overlay" / "regress" / "profiles" / f"{name}.yaml").read_text())
        server = doc["server"]
        args = [str(a) for a in server["args"]]
        assert args[args.index("--dcp-comm-backend") + 1] == settings["backend"], name
        assert not any("q-replicate" in a or "q_replicate" in a for a in args), name
        env = {k: str(v) for k, v in (server.get("env") or {}).items()}
        assert {k: env.get(k) for k in settings["env"]} == settings["env"], name
        # the projection in the spelling of the build the profile runs (0.34.0's argument, 0.28.0's variable)
        said = args[args.index(ARGUMENT) + 1] if ARGUMENT in args else None
        assert (said or value_of_env(env.get("VLLM_DCP_PROJECT_BEFORE_MERGE"), name)) == settings["projection"], name
        assert "VLLM_DCP_Q_REPLICATE" not in env, name


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "RUN_CASE", "tests.engine.fake_run_case")
    monkeypatch.setenv("FAKE_FACTS", json.dumps(FACTS.to_dict()))  # the stand-in resolves as this release


def _run(tmp_path: Path, names: list[str], **env: str) -> tuple[list[dict], dict]:
    by = {c.name: c for c in cases(2, FACTS)}
    jobs = [check.Job(by[n], n) for n in names]
    if env:
        jobs = [check.Job(replace(j.case, env={**j.case.env, **env}), j.name)
                if j.case.role == "check" else j for j in jobs]
    out = tmp_path / "run"
    out.mkdir()
    records = check.run_jobs(jobs, tmp_path / "model", out, timeout=120, parallel=4, poll_s=0.05)
    summary = verdict.judge(records, out, None)
    verdict.report(out, summary, records, {"model": str(tmp_path / "model"), "vllm": "0.33.0",
                                           "release_facts": FACTS.to_dict()})
    return records, summary


def test_the_build_cases_run_and_pass_with_the_stand_in(tmp_path: Path, fake_engine: None) -> None:
    names = ["ref-dcp1", "ref-dcp1-mtp", *OWN, *RUNNERS, "dcp-a2a-direct-proj1-graph-mtp", "dcp-agrs-proj1-graph-mtp"]
    records, summary = _run(tmp_path, names)
    assert summary["verdict"] == "pass", [(r["name"], r.get("problems")) for r in records]
    by = {r["name"]: r for r in records}
    assert by["dcp-defaults-graph-mtp"]["resolved"] == {"dcp_comm_backend": "a2a", "dcp_q_replicate": True,
                                                        "use_v2_model_runner": True}
    assert by["ref-dcp1-mtp-v1"]["resolved"]["use_v2_model_runner"] is False
    assert by["ref-dcp1-mtp"]["verdict"] == "reference" and by["ref-dcp1-v1"]["verdict"] == "reference"
    assert by["ref-dcp1-mtp-v1"]["verdict"] == "pass"
    assert by["dcp-a2a-direct-proj1-qgather-graph-mtp"]["resolved"]["dcp_q_replicate"] is False
    assert by["dcp-defaults-graph-mtp"]["graphs"]["mode"] == "FULL"
    report = (tmp_path / "run" / "REPORT.md").read_text()
    assert f"- release facts: {FACTS.summary()}" in report
    assert "- vllm: `0.33.0`" in report and "| dcp-defaults-graph-mtp | check | ok | pass |" in report


def test_a_case_that_ran_the_other_runner_fails(tmp_path: Path, fake_engine: None) -> None:
    """An engine that ignored VLLM_USE_V2_MODEL_RUNNER=0 (or fell back from V2) did not run the case."""
    records, summary = _run(tmp_path, ["ref-dcp1", "ref-dcp1-v1", "ref-dcp1-mtp-v1"],
                            FAKE_RESOLVED='{"use_v2_model_runner": true}')
    assert summary["verdict"] == "fail" and [r["verdict"] for r in records] == ["reference", "reference", "fail"]
    assert records[2]["problems"] == ["resolved: use_v2_model_runner=True, the case runs False"]


def test_an_engine_resolving_otherwise_fails_the_case(tmp_path: Path, fake_engine: None) -> None:
    """A build that does not replicate the query by default (or ignores the option) is not the
    configuration the case claims to have run: it fails, saying what it resolved."""
    records, summary = _run(tmp_path, ["ref-dcp1", "ref-dcp1-mtp", "dcp-defaults-graph-mtp"],
                            FAKE_RESOLVED='{"dcp_q_replicate": false}')
    assert summary["verdict"] == "fail"
    assert records[2]["problems"] == ["resolved: dcp_q_replicate=False, the case runs True"]


def test_the_release_and_its_facts_are_read_from_the_tree(tmp_path: Path) -> None:
    tree = factskit.tree("0.33.0").write(tmp_path / "tree")
    (tree / "vllm" / "_version.py").write_text("__version__ = version = '0.33.0+ovl1a2b3c'\n")
    assert check.release_under_test(tree) == "0.33.0"
    assert check.facts_under_test(tree) == FACTS
    assert [c.name for c in cases(2, check.facts_under_test(tree))][2] == "dcp-defaults-graph-mtp"


def test_the_cases_follow_the_facts_not_the_version() -> None:
    """What a build runs is what its release is: a 0.28.0-shaped tree named 0.33.0 runs 0.28.0's cases, a
    0.33.0-shaped one named 0.28.0 or 0.99.0 runs 0.33.0's, and a release without Model Runner V1 (0.34.0)
    runs the release's own DCP cases but none under V1, nor judges a runner it cannot choose."""
    generic = [c.name for c in cases(2)]
    assert [c.name for c in cases(2, factskit.facts("0.33.0", like="0.28.0"))] == generic
    for named in ("0.28.0", "0.99.0"):
        facts = factskit.facts(named, like="0.33.0")
        assert [c.name for c in cases(2, facts)] == [c.name for c in cases(2, FACTS)]
        assert {c.release for c in cases(2, facts) if c.release} == {named}
    later = factskit.facts("0.34.0")
    names = [c.name for c in cases(2, later)]
    assert set(OWN) <= set(names) and not set(RUNNERS) & set(names)
    assert names == [n for n in (c.name for c in cases(2, FACTS)) if n not in RUNNERS]
    assert next(c for c in cases(2, later) if c.name == "ref-dcp1-mtp").resolves == {}
    assert [c.name for c in cases(1, later)] == [c.name for c in cases(1)]


def test_engine_check_refuses_a_release_the_facts_cannot_describe(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A tree whose GLM-5 the table does not know stops the check in one line naming what is missing,
    before a checkpoint is made."""
    from overlay.cli import main

    synthetic = factskit.tree("0.35.0", like="0.34.0")
    synthetic.files["vllm/model_executor/models/registry.py"] = \
        '_VLLM_MODELS = {"GlmMoeDsaForCausalLM": ("vllm.models.glm5", "GlmMoeDsaForCausalLM")}\n'
    synthetic.files["vllm/models/glm5.py"] = "class GlmMoeDsaForCausalLM:\n    pass\n"
    tree = synthetic.write(tmp_path / "tree")
    rc = main(["engine-check", "--out", str(tmp_path / "out"), "--tree", str(tree), "--model", str(tmp_path / "model")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0] == (f"error: engine-check: {tree}: vllm 0.35.0: the release facts cannot describe it: GLM-5's path: "
                      "GLM-5 resolves to vllm.models.glm5.GlmMoeDsaForCausalLM, which "
                      "overlay/releases/table.py:ATTENTION does not describe (add its attention class and DCP entry "
                      "there, with the evidence)")
    assert not (tmp_path / "model").exists()


def test_the_torch_under_test_and_the_releases_pin() -> None:
    """The report names the device's torch and, where it differs, the one the installed vLLM pins."""
    from importlib.metadata import PackageNotFoundError

    def version(name: str) -> str:
        return {"torch": "2.11.0+cu130"}[name]

    def requires(pins: list[str]) -> Callable[[str], list[str]]:
        return lambda name: pins

    assert check.torch_under_test(version, requires(["numpy", "torch==2.14.0"])) == "2.11.0 (vllm pins 2.14.0)"
    assert check.torch_under_test(version, requires(["torch==2.11.0"])) == "2.11.0"
    assert check.torch_under_test(version, requires(["torch>=2.10"])) == "2.11.0"

    def no_vllm(name: str) -> list[str]:
        raise PackageNotFoundError(name)

    def no_torch(name: str) -> str:
        raise PackageNotFoundError(name)

    assert check.torch_under_test(version, no_vllm) == "2.11.0"
    assert check.torch_under_test(no_torch, no_vllm) == ""


def test_engine_check_vllm_refuses_another_build_in_one_line(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``make engine-check VLLM=0.33.0`` on a machine whose engines would import another release stops
    before anything runs (no checkpoint written), naming both."""
    from overlay.cli import main

    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "_version.py").write_text("__version__ = version = '0.28.0+ovl1a2b3c'\n")
    rc = main(["engine-check", "--out", str(tmp_path / "out"), "--tree", str(tree), "--vllm", "0.33.0",
               "--model", str(tmp_path / "model")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].endswith(f"engine-check --vllm 0.33.0: the engines would import vllm 0.28.0 (--tree {tree}); "
                           "install or stage the 0.33.0 build first")
    assert not (tmp_path / "model").exists()


def test_the_gpus_under_test_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The record names the GPUs the engines saw (nvidia-smi's names of the visible devices), not only
    CUDA_VISIBLE_DEVICES, whose "0,1" says nothing of the machine a record was measured on."""
    asked: list[list[str]] = []

    def smi(names: str) -> Callable[[list[str]], str]:
        def query(args: list[str]) -> str:
            asked.append(args)
            return names
        return query

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert check.gpus_under_test(smi("NVIDIA H200\nNVIDIA H200\n")) == "2 x NVIDIA H200"
    assert asked[-1][-2:] == ["-i", "0,1"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert check.gpus_under_test(smi("NVIDIA H100 80GB HBM3\n")) == "1 x NVIDIA H100 80GB HBM3"
    assert "-i" not in asked[-1]

    def missing(args: list[str]) -> str:
        raise FileNotFoundError(args[0])

    assert check.gpus_under_test(missing) == ""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert check.gpus_under_test(missing) == "3"
