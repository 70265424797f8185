"""Bad input gives one-line errors naming the file and the fix, never a traceback or a silent success."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from overlay.build.apply import apply_series
from overlay.build.pins import Pin, load_pin
from overlay.build.series import Patch, Series
from overlay.errors import ApplyError, OverlayError, PinError, SeriesError
from overlay.git import git
from overlay.maintain.cherry_pick import CherryPickError, cherry_pick
from overlay.maintain.workspace import create, export, slug
from overlay.regress.workspace_plan import ServingConfig, build_config
from tests.rebasekit import BASE, FROM, fill, make_patch, series_dir
from tests.wheelkit import format_patch, make_release, make_wheel

A = b"".join(f"a{i} = {i}\n".encode() for i in range(20))
BEFORE = {"vllm/a.py": b"x = 1\ny = 2\n"}
AFTER = {"vllm/a.py": b"x = 1\ny = 3\n"}


@pytest.fixture
def workspace(tmp_path: Path) -> tuple[Path, Path]:
    d = tmp_path / "base"
    d.mkdir()
    wheel = make_wheel(d, {"vllm/a.py": A})
    p1 = format_patch({"vllm/a.py": A}, {"vllm/a.py": A.replace(b"a3 = 3", b"a3 = 33")}, "First fix", work=tmp_path)
    root = make_release(tmp_path, wheel, patches={"first.patch": p1})
    return root, create(root, "0.28.0", tmp_path / "ws", base_wheel=wheel)


def _commit(ws: Path, name: str, subject: str = "Second fix") -> None:
    (ws / "vllm" / "a.py").write_bytes((ws / "vllm" / "a.py").read_bytes().replace(b"a9 = 9", b"a9 = 99"))
    git(["commit", "-q", "-am", f"{subject}\n\nBody.\n\nOrigin: vendor\nLast-Update: 2026-11-30\n"
         f"Patch-Name: {name}\n"], ws)


def _snapshot(directory: Path) -> list[tuple[str, bytes]]:
    return sorted((p.name, p.read_bytes()) for p in directory.iterdir())


# --------------------------------------------------------------------------- 4: export of a dirty workspace

def test_export_refuses_uncommitted_and_untracked_edits(workspace: tuple[Path, Path]) -> None:
    root, ws = workspace
    before = _snapshot(root / "0.28.0")
    (ws / "vllm" / "a.py").write_bytes(b"edited\n")
    (ws / "vllm" / "new.py").write_bytes(b"new\n")
    (ws / "vllm" / "__pycache__").mkdir()
    (ws / "vllm" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    with pytest.raises(OverlayError) as exc:
        export(ws, root, "0.28.0")
    msg = str(exc.value)
    assert msg.startswith(f"{ws}: uncommitted changes would not be exported: vllm/a.py, vllm/new.py; ")
    assert "commit them" in msg and "allow_dirty" not in msg and "__pycache__" not in msg
    assert _snapshot(root / "0.28.0") == before
    assert export(ws, root, "0.28.0", allow_dirty=True) == ["first.patch"]  # the commits only
    from overlay.cli import main

    assert main(["--patches", str(root), "export", "--src", str(ws)]) == 1  # through the CLI: refused...
    assert main(["--patches", str(root), "export", "--src", str(ws), "--allow-dirty"]) == 0  # ...or the commits


# --------------------------------------------------------------------------- 5: one-line errors

def test_series_file_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "series").mkdir()
    with pytest.raises(SeriesError, match=rf"^{re.escape(str(tmp_path / 'series'))}: is a directory, not a "):
        Series.load(tmp_path)


def test_series_file_not_utf8(tmp_path: Path) -> None:
    (tmp_path / "series").write_bytes(b"# c\n\xff.patch\n")
    with pytest.raises(SeriesError, match=rf"^{re.escape(str(tmp_path / 'series'))}:2: not UTF-8 text .*"
                                          r"save it as UTF-8$"):
        Series.load(tmp_path)


def test_patch_file_not_utf8(tmp_path: Path) -> None:
    raw = format_patch(BEFORE, AFTER, "Fix y", work=tmp_path).replace(b"Why it", b"Why \xe9t")
    (tmp_path / "series").write_text("a.patch\n")
    (tmp_path / "a.patch").write_bytes(raw)
    with pytest.raises(SeriesError, match=rf"^{re.escape(str(tmp_path / 'a.patch'))}:\d+: not UTF-8 text "
                                          r".*save it as UTF-8"):
        Series.load(tmp_path)


def test_patch_path_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "a.patch").mkdir()
    with pytest.raises(SeriesError, match=r"a.patch: is a directory, not a patch file"):
        Patch.load(tmp_path / "a.patch")


def test_pin_file_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "0.28.0" / "pin.toml").mkdir(parents=True)
    with pytest.raises(PinError, match=r"pin.toml: is a directory, not a pin file; remove it and write "):
        load_pin(tmp_path, "0.28.0")


def test_pin_file_not_utf8(tmp_path: Path) -> None:
    (tmp_path / "0.28.0").mkdir()
    (tmp_path / "0.28.0" / "pin.toml").write_bytes(Pin("0.28.0", "vllm-0.28.0-x.whl", "ab" * 32)
                                                   .to_toml().encode() + b"# \xff\n")
    with pytest.raises(PinError, match=r"pin.toml:6: not UTF-8 text .*save it as UTF-8$"):
        load_pin(tmp_path, "0.28.0")


# --------------------------------------------------------------------------- 6: workspace-plan numbers

@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param({"tp": -8}, r"--tp \(tp\) must be a positive integer, got -8", id="tp"),
        pytest.param({"tp": 0}, r"--tp \(tp\) must be a positive integer, got 0", id="tp-zero"),
        pytest.param({"max_num_seqs": -5}, r"--max-num-seqs \(max_num_seqs\) must be a positive integer, got -5",
                     id="seqs"),
        pytest.param({"query_dtype_bytes": 3}, r"--query-dtype-bytes \(query_dtype_bytes\) must be 1, 2 or 4 "
                     r"\(fp8, bf16/fp16, fp32\), got 3", id="dtype"),
        pytest.param({"speculative_tokens": -1}, r"must be 0 or a positive integer, got -1", id="spec"),
        pytest.param({"num_ubatches": 0}, r"--num-ubatches \(num_ubatches\) must be a positive integer", id="ub"),
        pytest.param({"kv_lora_rank": 0}, r"--kv-lora-rank", id="rank"),
        pytest.param({"qk_rope_head_dim": -64}, r"--rope-dim \(qk_rope_head_dim\)", id="rope"),
        pytest.param({"cudagraph_capture_size": -1}, r"--cudagraph-capture-size", id="capture"),
        pytest.param({"max_num_batched_tokens": -8192}, r"--max-num-batched-tokens", id="mnbt"),
        pytest.param({"max_num_seqs": 512, "max_num_batched_tokens": 256},
                     r"--max-num-batched-tokens \(256\) must be at least --max-num-seqs \(512\)", id="mnbt<seqs"),
        pytest.param({"dcp": 3}, r"--dcp \(dcp\) must divide --tp 8", id="dcp"),
        pytest.param({"num_heads": 60}, r"--num-heads \(num_heads\) 60 must be divisible by --tp 8", id="heads"),
        pytest.param({"q_padded_heads": 8}, r"--q-padded-heads .* at least DCP x heads per rank \(64\)",
                     id="padded"),
        pytest.param({"tp": "8"}, r"--tp \(tp\) must be a positive integer, got '8'", id="type"),
        pytest.param({"v_head_dim": 0}, r"^--v-head-dim \(v_head_dim\) must be a positive integer, got 0$",
                     id="v-head-dim"),
        pytest.param({"num_layers": -78}, r"^--num-layers \(num_layers\) must be a positive integer, got -78$",
                     id="layers"),
        pytest.param({"project_before_merge": "0"},
                     r"^--project-before-merge \(project_before_merge\) must be true or false, got '0'$",
                     id="projection"),
    ],
)
def test_workspace_plan_rejects_nonsense(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config(**overrides)


def test_workspace_plan_reports_every_bad_field_at_once() -> None:
    with pytest.raises(ValueError) as exc:
        ServingConfig(tp=-8, max_num_seqs=-5, query_dtype_bytes=3)
    assert str(exc.value).count(";") == 2


# --------------------------------------------------------------------------- 7: hunk header line

def test_malformed_hunk_header_line_counts_from_the_file_start(tmp_path: Path) -> None:
    raw = format_patch(BEFORE, AFTER, "Fix y", work=tmp_path)
    line = raw.splitlines().index(b"@@ -1,2 +1,2 @@") + 1
    assert line > 10
    bad = raw.replace(b"@@ -1,2 +1,2 @@", b"@@ -x +1 @@")
    with pytest.raises(SeriesError, match=rf"bad.patch:{line}: malformed hunk header '@@ -x \+1 @@'"):
        Patch.from_bytes("bad.patch", bad, tmp_path / "bad.patch")


# --------------------------------------------------------------------------- 8: names export writes

@pytest.mark.parametrize(
    ("name", "message"),
    [
        pytest.param("01-tweak.patch", "has a numeric prefix", id="numbered"),
        pytest.param("tweak.diff", "not a patch file name", id="suffix"),
        pytest.param("../../evil.patch", "must not contain '/'.*plain file name", id="path-up"),
        pytest.param("sub/x.patch", "must not contain '/'.*plain file name", id="path-down"),
    ],
)
def test_export_refuses_names_the_series_parser_refuses(workspace: tuple[Path, Path], name: str,
                                                         message: str) -> None:
    root, ws = workspace
    before = _snapshot(root / "0.28.0")
    _commit(ws, name)
    with pytest.raises(SeriesError, match=rf"Patch-Name: .*{message}.*git rebase -i base"):
        export(ws, root, "0.28.0")
    assert _snapshot(root / "0.28.0") == before
    assert not (root / "evil.patch").exists() and not (root.parent / "evil.patch").exists()


@pytest.mark.parametrize(("subject", "name"), [("01 tweak", "tweak.patch"), ("2nd try", "nd-try.patch"),
                                               ("42", "patch.patch")])
def test_slug_is_a_valid_series_name(subject: str, name: str) -> None:
    assert slug(subject) == name
    assert Series.parse_names(slug(subject), "s") == [name]


# --------------------------------------------------------------------------- 9: files outside the package

@pytest.mark.parametrize(
    "path",
    ["sitecustomize.py", "vllm-0.28.0.dist-info/RECORD", "vllm/../evil.py", "tests/test_x.py"],
)
def test_series_refuses_files_outside_the_package(tmp_path: Path, path: str) -> None:
    raw = format_patch({}, {path: b"import os\n"}, "Sneak", work=tmp_path) if ".." not in path else (
        format_patch({}, {"vllm/evil.py": b"import os\n"}, "Sneak", work=tmp_path)
        .replace(b"vllm/evil.py", b"vllm/../evil.py"))
    (tmp_path / "series").write_text("sneak.patch\n")
    (tmp_path / "sneak.patch").write_bytes(raw)
    with pytest.raises(SeriesError, match=rf"sneak.patch: {re.escape(path)}: outside the vllm package"):
        Series.load(tmp_path)
    patch = Patch.from_bytes("sneak.patch", raw, tmp_path / "sneak.patch")
    with pytest.raises(ApplyError, match=rf"patch sneak.patch: {re.escape(path)}: outside the vllm package"):
        apply_series((patch,), lambda p: None)


def test_kernel_sources_stay_allowed(tmp_path: Path) -> None:
    raw = format_patch({"csrc/x.cu": b"a\n", "CMakeLists.txt": b"a\n"},
                       {"csrc/x.cu": b"b\n", "CMakeLists.txt": b"b\n", "vllm/k.py": b"k\n"}, "Kernel", work=tmp_path)
    (tmp_path / "series").write_text("k.patch\n")
    (tmp_path / "k.patch").write_bytes(raw)
    assert Series.load(tmp_path).patches[0].kind == "kernel"


@pytest.mark.parametrize("version", sorted(p.name for p in (Path(__file__).parent.parent / "patches").iterdir()
                                            if p.is_dir()))
def test_shipped_series_stay_in_the_package(version: str) -> None:
    Series.load(Path(__file__).parent.parent / "patches" / version)


# --------------------------------------------------------------------------- 10: cherry-pick of a missing file

@pytest.mark.parametrize("ref", ["/nonexistent.patch", "./x.diff", "~/nope.patch", "fix.patch", "../up/x"])
def test_cherry_pick_missing_file_is_not_a_commit(tmp_path: Path, ref: str) -> None:
    root = tmp_path / "patches"
    series_dir(root, {"a.patch": make_patch(tmp_path, "a", {"vllm/a.py": "a = 1\n"})})
    called: list[Path] = []
    with pytest.raises(CherryPickError) as exc:
        cherry_pick(root, FROM, ref, fill_base=lambda d: called.append(d) or fill(BASE)(d),
                    work=tmp_path / "work", remote="/unreachable/remote")
    assert str(exc.value) == f"no such file: {ref}"
    assert called == [] and not (tmp_path / "work").exists()


def test_cherry_pick_directory_ref(tmp_path: Path) -> None:
    root = tmp_path / "patches"
    series_dir(root, {"a.patch": make_patch(tmp_path, "a", {"vllm/a.py": "a = 1\n"})})
    with pytest.raises(CherryPickError, match=r"^.*patches: is a directory, not a patch file$"):
        cherry_pick(root, FROM, str(root), fill_base=fill(BASE), work=tmp_path / "work", remote="/unreachable")
