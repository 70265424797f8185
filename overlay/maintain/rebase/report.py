"""The release folder a finished rebase writes: ``patches/<to>/`` with the carried patches,
``rebase.json`` and ``REBASE.md``."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from overlay.atomic import temp_dir
from overlay.build.pins import Pin, pin_dir
from overlay.build.series import Patch, Series
from overlay.build.swap import exchange
from overlay.errors import OverlayError
from overlay.maintain.engine_records import RECORDS, EngineRun, engine_runs, records_root
from overlay.maintain.rebase.stale import later_pin_notes
from overlay.maintain.rebase.state import OUTCOMES, RebaseError, Result, State, prepared_pin
from overlay.maintain.rebase.testrun import TestRun, describe
from overlay.maintain.replay import ConflictHunk
from overlay.maintain.workspace import format_patch
from overlay.releases.facts import ReleaseFacts


def write_release(work: Path, state: State, series: Series, results: list[Result]) -> Path:
    patches_root = Path(state.patches_root)
    out = pin_dir(patches_root, state.to_version)
    try:
        prepared = prepared_pin(patches_root, state.to_version)
    except RebaseError as exc:
        raise RebaseError(f"{out}: changed while the rebase ran; not overwriting it ({exc})") from None
    pin = Pin.from_dict(state.pin, f"target pin of the rebase onto {state.to_version}")
    with temp_dir(patches_root, ".rebase-", legacy=(f".rebase-{state.to_version}-",)) as tmp:
        names: list[str] = []
        for patch, res in zip(series.patches, results, strict=True):
            how = state.exported.get(patch.name)
            if not res.carried or how is None:
                continue
            raw = patch.raw if how == "verbatim" else format_patch(work, how)
            Patch.from_bytes(patch.name, raw, tmp / patch.name)  # refuse to write a broken file
            (tmp / patch.name).write_bytes(raw)
            names.append(patch.name)
        (tmp / "series").write_text(Series.render(names, header_from=(
            f"# Patch series for vLLM {state.to_version}, applied in this order by `make build`.\n"
            f"# Rebased from {state.from_version} by `make rebase` (see REBASE.md).\n")))
        if prepared is not None:  # the person's own file, comments and all
            shutil.copy2(out / "pin.toml", tmp / "pin.toml")
        else:
            (tmp / "pin.toml").write_text(pin.to_toml())
        write_report(tmp, state, results, work)
        os.chmod(tmp, 0o755)
        if out.exists():  # prepared by a person (empty, or only pin.toml): swapped in one step
            exchange(tmp, out)
        else:
            os.replace(tmp, out)
    return out


def write_report(dest: Path, state: State, results: list[Result], work: Path, *,
                  pending: list[str] | None = None, unclassified: list[str] | None = None) -> None:
    """``rebase.json`` and ``REBASE.md`` into ``dest`` (the release folder, or the worktree);
    ``unclassified``: the run is still going and these patches are not classified yet."""
    doc: dict[str, object] = {
        "from": state.from_version,
        "to": state.to_version,
        "target": state.pin,
        "trust": _TRUST,
        "pending": pending or [],
        "patches": [{"name": r.name, "outcome": r.outcome, "evidence": r.evidence, "carried": r.carried,
                     "still_needed": r.still_needed, "absorbed": r.absorbed, "behaviour": r.behaviour,
                     "conflicts": r.conflicts, "candidates": r.candidates, "source_sha256": r.source_sha256,
                     "changes": r.changes, **({"reason": r.reason} if r.reason else {}),
                     **({"on_model_path": r.on_model_path} if r.on_model_path else {})}
                    for r in results],
    }
    if state.facts:
        doc["facts"] = state.facts
    if unclassified is not None:
        doc["in_progress"] = {"classified": len(results), "unclassified": unclassified}
    (dest / "rebase.json").write_text(json.dumps(doc, indent=2) + "\n")
    (dest / "REBASE.md").write_text(report_markdown(state, results, work=work, pending=pending,
                                                    unclassified=unclassified))
    if dest == work:  # keep the report out of `git status` / `git add -A` there
        exclude = work / ".git" / "info" / "exclude"
        exclude.parent.mkdir(parents=True, exist_ok=True)
        have = exclude.read_text() if exclude.is_file() else ""
        if "/REBASE.md" not in have.split():
            exclude.write_text(have + "/REBASE.md\n/rebase.json\n")


_TRUST = ("the target wheel's sha256 is the digest PyPI publishes for it (read through pip's "
          "resolver report); pip checked the download against it and the tool hashed the file again")



def report_markdown(state: State, results: list[Result], *, work: Path | None = None,
                    pending: list[str] | None = None, unclassified: list[str] | None = None) -> str:
    """``REBASE.md``: a table, the resolution steps when patches need a person, the reasoning per
    patch, and what other pins rebased from the same base carry (``unclassified``: a run still going)."""
    lines = [f"# Rebase of the series from vLLM {state.from_version} to {state.to_version}", ""]
    if unclassified is not None:
        lines += [f"**In progress** (or stopped): {len(results)} of {len(results) + len(unclassified)} "
                  f"patches classified; not yet: {', '.join(unclassified) or 'none'}.", ""]
    lines += [
        f"Target wheel `{state.pin['wheel']}`, sha256 `{state.pin['sha256']}`: {_TRUST}.",
        "",
        "| patch | outcome | carried | evidence |",
        "| --- | --- | --- | --- |",
    ]
    for r in results:
        short = r.evidence.split("; ")[0]
        depends = re.search(r"(?:depends on|rests on lines written by) set-aside ([\w.-]+)", r.evidence)
        if depends:
            short += f" (depends on set-aside `{depends[1]}`)"
        short = short.replace("|", "\\|")
        lines.append(f"| `{r.name}` | {r.outcome} | {'yes' if r.carried else 'no'} | {short} |")
    lines += release_facts_table(state.facts)
    if pending:
        lines += ["", f"## To resolve: {len(pending)} patch(es) need a person", "",
                  f"`{pending[0]}` waits in `{work}` mid-cherry-pick, its conflicts staged as in any git merge "
                  "(a patch whose tests the target contradicts and that merges cleanly waits applied as the "
                  "commit on top: keep or amend it, or drop it with `git reset --hard HEAD~1`).",
                  "",
                  "1. Resolve there with plain git (edit, `git add <file>`), or make the patch empty "
                  "(`git checkout HEAD -- .`) to drop it, or leave it out of the series with the reason: "
                  f"`make rebase-continue TO={state.to_version} LEFT_OUT=1 WHY=\"...\"` (recorded as left-out, "
                  "the reason in this report and rebase.json; no step 2 then).",
                  f"2. `make rebase-continue TO={state.to_version}`: it records the patch as conflict-resolved and "
                  "classifies the later patches again on top of it (candidates included), stopping at the next "
                  "patch that still needs a person.",
                  f"3. When nothing is left, `patches/{state.to_version}/` is written with the final report.",
                  "", "Set aside in this run: " + ", ".join(f"`{n}`" for n in pending) + "."]
    lines += ["", "## Reasoning", ""]
    for r in results:
        lines += [f"### `{r.name}`: {r.outcome}", "", f"{OUTCOMES[r.outcome]}. {r.evidence}.", ""]
        if r.still_needed:
            lines += ["Still needed: " + ", ".join(f"`{s}`" for s in r.still_needed) + ".", ""]
        if r.absorbed:
            lines += ["Already upstream: " + ", ".join(f"`{s}`" for s in r.absorbed) + ".", ""]
        if r.changes:
            lines += ["Changes (on the target): " + "; ".join(f"`{c}`" for c in r.changes) + ".", "",
                      f"On GLM-5's path: {on_model_path(r)}.", ""]
        for label, raw in r.behaviour.items():
            run = TestRun.from_dict(raw)
            lines.append(f"- its tests on the {label.replace('-', ' ')}: {describe(run)}")
            if label in ("target", "target-with-it"):
                for test, kind, why in list(zip(run.failed, run.kinds, run.reasons, strict=False))[:5]:
                    said = {"harness": "cannot run there (harness error)",
                            "off-path": "off the model's path there"}.get(kind, "still failing there")
                    lines.append(f"  - {said}: `{test}`: {why}")
        for c in r.conflicts:
            lines.append(f"- conflict: {ConflictHunk(**c).describe()}")
        for a in r.candidates:
            verdict = "accepted" if a["accepted"] else "rejected"
            lines.append(f"- candidate {a['name']} ({a['description']}): {verdict}: {a['why']}"
                         + (f" [commit {a['commit'][:12]}; files {', '.join(a['files'])}]" if a["commit"] else ""))
        if r.source_sha256:
            lines.append(f"- rebased from the source patch with sha256 `{r.source_sha256}`")
        if r.behaviour or r.conflicts or r.candidates or r.source_sha256:
            lines.append("")
    lines += _other_pins(state)
    lines += proven_in_an_engine(state.to_version, engine_runs(records_root(Path(state.patches_root)),
                                                               state.to_version))
    return "\n".join(lines).rstrip() + "\n"


def release_facts_table(facts: dict) -> list[str]:
    """``REBASE.md``'s "Release facts": what the tools key by release, old base against target (changes in
    bold); nothing when the run has no facts (a rebase of synthetic trees)."""
    if not (facts.get("from") and facts.get("to")):
        return []
    old, new = ReleaseFacts.from_dict(facts["from"]), ReleaseFacts.from_dict(facts["to"])
    lines = ["", "## Release facts", "",
             "What the tools key by release (`overlay/releases/`), read from each wheel's own tree; **bold**: "
             "changed.", "", f"| fact | {old.release} | {new.release} |", "| --- | --- | --- |"]
    for (label, was), (_, now) in zip(old.rows(), new.rows(), strict=True):
        lines.append(f"| {label} | {was} | {now if now == was else f'**{now}**'} |")
    return lines


def on_model_path(r: Result) -> str:
    """Whether GLM-5 runs the carried patch on the target, as its tests with it there say."""
    raw = r.behaviour.get("target-with-it")
    if not raw:
        return "not judged (no test run with it on the target)"
    run = TestRun.from_dict(raw)
    if r.on_model_path:
        return f"yes, by its GLM-5 path tests: {r.on_model_path}"
    if run.off_path_failed:
        return (f"no: {len(run.off_path_failed)} of its tests find it off the path GLM-5 runs "
                f"(`{run.off_path_failed[0]}`)")
    if run.status == "passed":
        return ("not found off it: its tests pass with it there (only the GLM-5 path harness's tests, "
                "`tests/patches/*__glm5_path.py`, judge the path)")
    return f"its tests with it there: {describe(run)}"


def proven_in_an_engine(version: str, runs: list[EngineRun]) -> list[str]:
    """``REBASE.md``'s "Proven in an engine": whether this release's build has run in a real engine (the
    records where the guides put them, ``docs/records/engine/``: where, when, at which DCP sizes, which
    cases), so that "rebased" (the patches apply and their CPU tests judge them) is not read as "serves and
    decodes right". A snapshot of when the report was written; ``make status`` says what is proven now."""
    lines = ["## Proven in an engine", ""]
    if not runs:
        lines.append(f"Never: no engine has started the vLLM {version} build (no engine-check record under "
                     f"`{RECORDS}/` names it: `meta.vllm` {version} in its results). What judged it is "
                     "the CPU tests above (the release's own Python code, GPU kernels replaced at their call "
                     "boundary): it applies and those tests pass; that it starts, serves and decodes right is not "
                     f"shown. To show it: `make build VLLM={version}`, then the engine check on GPUs "
                     "(`docs/engine/`).")
    else:
        lines.append(f"{len(runs)} engine-check run(s) of the vLLM {version} build (`{RECORDS}/`; what each "
                     "proves of each patch: `make status`):")
    for run in runs:
        cases = ", ".join(f"`{c.name}` {c.verdict}" for c in run.cases) or "no cases"
        gpus = f", GPUs `{run.gpus}`" if run.gpus else ""
        dcp = ", ".join(map(str, sorted({c.dcp for c in run.cases}))) or "-"
        lines.append(f"- `{run.where}` (started {run.when}{gpus}; DCP {dcp}): {run.verdict}; {cases}")
    lines.append("")
    return lines


def _other_pins(state: State) -> list[str]:
    """Other pins rebased from the same base that carry an older version of a patch, or lack one."""
    try:
        notes = later_pin_notes(Path(state.patches_root), state.from_version)
    except OverlayError:
        return []
    rows = [f"- `{name}`: {n.describe()}" for name, found in notes.items() for n in found
            if n.pin != state.to_version]
    if not rows:
        return []
    return ["## Other pins rebased from " + state.from_version, "", *rows, ""]


