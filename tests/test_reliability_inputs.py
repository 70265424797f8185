"""Issue 35 item 4, *inputs silently accepted or blamed on the wrong thing*: text files an editor saved
with a byte-order mark, as UTF-16 or with CRLF endings; a rebase onto the series' own or an older
release; an empty series; empty option values; YAML aliases; a patch whose change an earlier patch
already made.

Each test's docstring says what the code did before.
"""

from __future__ import annotations

import argparse
import codecs
from pathlib import Path

import pytest

from overlay.cli import main
from overlay.errors import OverlayError
from tests.wheelkit import BASE_FILES, good_patch, make_release, make_wheel

BOM = codecs.BOM_UTF8


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str], rc: int = 1) -> str:
    """Run the CLI; assert exit ``rc`` with one ``error:`` line and no traceback; return the line."""
    got = main(argv)
    err = capsys.readouterr().err
    assert got == rc and "Traceback" not in err, err
    (line,) = err.splitlines()
    assert line.startswith("error: ")
    return line


@pytest.fixture
def release(tmp_path: Path) -> tuple[Path, Path]:
    """(patches root, base wheel): release 0.28.0 with the one good patch ``fix-a.patch``."""
    (tmp_path / "base").mkdir()
    wheel = make_wheel(tmp_path / "base", BASE_FILES)
    return make_release(tmp_path, wheel, patches={"fix-a.patch": good_patch(tmp_path)}), wheel


def _build(root: Path, wheel: Path, dist: Path) -> list[str]:
    return ["--patches", str(root), "build", "--dist", str(dist), "--base-wheel", str(wheel)]


# --- encodings -------------------------------------------------------------------------------------------

def _prefix(path: Path, head: bytes) -> None:
    path.write_bytes(head + path.read_bytes())


@pytest.mark.parametrize(("file", "head", "said"), [
    pytest.param("pin.toml", BOM, "starts with a UTF-8 byte-order mark (EF BB BF)", id="pin-utf8-bom"),
    pytest.param("series", BOM, "starts with a UTF-8 byte-order mark (EF BB BF)", id="series-utf8-bom"),
    pytest.param("fix-a.patch", BOM, "starts with a UTF-8 byte-order mark (EF BB BF)", id="patch-utf8-bom"),
    pytest.param("pin.toml", codecs.BOM_UTF16_LE, "starts with a UTF-16 byte-order mark (FF FE): the file is "
                 "UTF-16 text", id="pin-utf16"),
])
def test_a_byte_order_mark_is_named(capsys: pytest.CaptureFixture[str], release: tuple[Path, Path],
                                    tmp_path: Path, file: str, head: bytes, said: str) -> None:
    """Before: a BOM in ``pin.toml`` was ``not valid TOML: Invalid statement (at line 1, column 1)``; in the
    ``series``, its first name was ``not a patch file name ...: <14 characters with control characters, not
    shown>``; before a patch, ``not a git format-patch file (no 'From ' line)``; UTF-16 was ``not UTF-8 text
    (invalid start byte at byte 0)``. None said what the bytes were."""
    root, wheel = release
    path = root / "0.28.0" / file
    _prefix(path, head)
    line = _one_line(capsys, _build(root, wheel, tmp_path / "dist"))
    assert line == f"error: {path}: {said}; save it as UTF-8 without a byte-order mark"
    assert not (tmp_path / "dist").exists()


def test_a_bom_in_patches_default_is_named(capsys: pytest.CaptureFixture[str], release: tuple[Path, Path]) -> None:
    """Before: ``patches/DEFAULT: expected one release like 0.28.0, got <7 characters with control characters,
    not shown>``."""
    root, _ = release
    (root / "DEFAULT").write_bytes(BOM + b"0.28.0\n")
    line = _one_line(capsys, ["--patches", str(root), "status"])
    assert line == f"error: {root / 'DEFAULT'}: starts with a UTF-8 byte-order mark (EF BB BF); save it as UTF-8 " \
                   "without a byte-order mark"


def test_a_crlf_patch_is_named(capsys: pytest.CaptureFixture[str], release: tuple[Path, Path],
                               tmp_path: Path) -> None:
    """Before: ``fix-a.patch: no blank line after the mail headers`` (the blank line is ``\\r``), which sent
    a person looking at the headers, not the line endings."""
    root, wheel = release
    patch = root / "0.28.0" / "fix-a.patch"
    patch.write_bytes(patch.read_bytes().replace(b"\n", b"\r\n"))
    line = _one_line(capsys, _build(root, wheel, tmp_path / "dist"))
    assert line == (f"error: {patch}:1: CRLF line endings (an editor or git's core.autocrlf converted the file); "
                    "save it with LF line endings")


def test_a_patch_of_a_crlf_file_still_builds(tmp_path: Path) -> None:
    """The CRLF check reads the patch's own lines (``From``, ``diff --git``, ``@@``): a hunk of a file whose
    lines end in CR LF is content, and builds as before."""
    from overlay.build.pipeline import build
    from tests.wheelkit import format_patch

    dos = b"".join(f"x_{i} = {i}\r\n".encode() for i in range(10))
    (tmp_path / "base").mkdir()
    wheel = make_wheel(tmp_path / "base", {**BASE_FILES, "vllm/dos.py": dos})
    patch = format_patch({"vllm/dos.py": dos}, {"vllm/dos.py": dos.replace(b"x_4 = 4\r\n", b"x_4 = 40\r\n")},
                         "Change a CRLF file", work=tmp_path)
    root = make_release(tmp_path, wheel, patches={"dos.patch": patch})
    result = build(root, "0.28.0", tmp_path / "dist", base_wheel=wheel)
    assert result.patches == 1


@pytest.mark.parametrize(("head", "said"), [
    pytest.param(codecs.BOM_UTF16_LE, "starts with a UTF-16 byte-order mark (FF FE)", id="utf16"),
    pytest.param(b"\xff\xfe\x00\x00", "starts with a UTF-32 byte-order mark (FF FE 00 00)", id="utf32"),
])
def test_other_text_inputs_name_their_encoding(tmp_path: Path, head: bytes, said: str) -> None:
    """The other files a person writes or copies: a regress profile (before: a ``UnicodeDecodeError``
    traceback), ``upstream_expected/<version>.toml`` (``cannot read: 'utf-8' codec can't decode ...``),
    and device-stage's ``--device-packages`` (PowerShell's ``>`` writes UTF-16; before: a
    ``UnicodeDecodeError`` traceback)."""
    from overlay.device.requirements import read_device_packages
    from overlay.maintain.upstream_tests import Expectations
    from overlay.regress.profiles import load_profile

    for name, load in (
        ("p.yaml", load_profile),
        ("e.toml", Expectations.load),
        ("packages.txt", read_device_packages),
    ):
        path = tmp_path / name
        path.write_bytes(head + "x = 1\n".encode("utf-16-le"))
        with pytest.raises(OverlayError) as exc:
            load(path if name != "p.yaml" else str(path))
        assert str(exc.value).startswith(f"{path}: {said}"), exc.value


def test_a_ref_file_names_its_encoding(tmp_path: Path) -> None:
    """Before: ``differential: R: cannot read recorded outputs: 'utf-8' codec can't decode byte 0xff in
    position 0``; a UTF-8 BOM went on to the JSON parser."""
    pytest.importorskip("pydantic")
    from overlay.regress.differential import reference
    from overlay.regress.profiles import DifferentialSpec

    ref = tmp_path / "ref.json"
    ref.write_bytes(codecs.BOM_UTF16_LE + b"{}")
    with pytest.raises(OverlayError) as exc:
        reference(DifferentialSpec(), [[1, 2]], None, str(ref), print)
    assert str(exc.value).startswith(f"differential: {ref}: starts with a UTF-16 byte-order mark"), exc.value


def test_a_profile_may_start_with_yamls_own_byte_order_mark(tmp_path: Path) -> None:
    """YAML allows a UTF-8 BOM (PyYAML drops it): a profile saved with one loads as before."""
    from overlay.regress.profiles import load_profile

    shipped = Path(__file__).resolve().parent.parent / "overlay" / "regress" / "profiles" / "glm5.2-fp8-tp8-dcp8.yaml"
    path = tmp_path / "p.yaml"
    path.write_bytes(BOM + shipped.read_bytes())
    assert load_profile(str(path)).name == load_profile("glm5.2-fp8-tp8-dcp8").name


# --- YAML ------------------------------------------------------------------------------------------------

def _alias_bomb(levels: int = 9) -> str:
    """A profile whose ``description`` is 9**10 strings in 12 lines of nested aliases."""
    lines = ["name: bomb", 'a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join([*lines, f"description: *a{levels}"]) + "\n"


def test_a_yaml_alias_bomb_is_refused_at_its_line(tmp_path: Path) -> None:
    """Before: ``yaml.safe_load`` built the shared nodes cheaply, then the error line's ``got {value!r}``
    (``description: expected a string``) expanded 3.5 billion strings: memory ran out (``MemoryError``
    under a 3 GB limit, the machine swapping without one). Run in a child with a 2 GB address-space limit,
    so the code before fails here by ``MemoryError`` rather than take the machine down."""
    import subprocess
    import sys

    profile = tmp_path / "bomb.yaml"
    profile.write_text(_alias_bomb())
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
            "from overlay.regress.profiles import load_profile\n"
            "from overlay.errors import OverlayError\n"
            "try:\n    load_profile(sys.argv[1])\n"
            "except OverlayError as exc:\n    print(exc)\n")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code, str(profile)], cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == (f"{profile}: line 3 not valid YAML: an alias (*a0): aliases are not allowed in a profile "
                           "(a few lines of them can stand for gigabytes); write the value out\n")


def test_an_error_line_shows_a_large_value_cut(tmp_path: Path) -> None:
    """Without aliases a value is as large as the file: ``name: [0, 1, ..., 99999]`` was printed whole into
    the error line (600 kB). Now its first items, then ``...``."""
    from overlay.regress.errors import ProfileError
    from overlay.regress.profiles import load_profile

    profile = tmp_path / "big.yaml"
    profile.write_text("name: [" + ", ".join(str(i) for i in range(100_000)) + "]\n")
    with pytest.raises(ProfileError) as exc:
        load_profile(str(profile))
    first = str(exc.value).split("; ")[0]
    assert first == f"{profile}: name: expected a string, got [0, 1, 2, 3, ...]"
    assert len(str(exc.value)) < 2000


def test_a_profile_larger_than_a_mebibyte_is_refused_unread(tmp_path: Path) -> None:
    """Before: read whole, whatever its size (a profile path naming a 2 GB file was read into memory)."""
    from overlay.regress.errors import ProfileError
    from overlay.regress.profiles import load_profile

    profile = tmp_path / "huge.yaml"
    with profile.open("wb") as f:
        f.truncate((1 << 20) + 1)  # sparse
    with pytest.raises(ProfileError, match=r"larger than a profile may be \(1048576 bytes\)$"):
        load_profile(str(profile))


def test_a_character_yaml_refuses_is_one_line(tmp_path: Path) -> None:
    """Before: PyYAML's ``ReaderError`` has no ``problem``: its whole text went into the error, two lines
    (``unacceptable character #x0001: special characters are not allowed\\n  in "<unicode string>",
    position 23``)."""
    from overlay.regress.errors import ProfileError
    from overlay.regress.profiles import load_profile

    profile = tmp_path / "ctl.yaml"
    profile.write_bytes(b'name: x\ndescription: "a\x01b"\n')
    with pytest.raises(ProfileError) as exc:
        load_profile(str(profile))
    assert str(exc.value) == (f"{profile}: line 2 not valid YAML: the character U+0001 (YAML allows printable "
                              "characters, tab and newlines only)")


# --- the rebase's target ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("to", "said"), [
    pytest.param("0.28.0", "is the series' own release ({d}/, VLLM=0.28.0): a rebase carries that series onto a "
                 "later release; name one after 0.28.0", id="own-release"),
    pytest.param("0.27.0", "is older than the series' release ({d}/, VLLM=0.28.0): a rebase carries a series "
                 "forward only; name a release after 0.28.0", id="older"),
    pytest.param("0.28.0rc1", "is older than the series' release ({d}/, VLLM=0.28.0): a rebase carries a series "
                 "forward only; name a release after 0.28.0", id="its-release-candidate"),
])
def test_a_rebase_onto_its_own_or_an_older_release_is_refused_before_any_download(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, release: tuple[Path, Path],
    tmp_path: Path, to: str, said: str,
) -> None:
    """Before: ``TO=0.28.0`` (the pinned release) fetched the base wheel, then said ``patches/0.28.0: already
    exists (holds ...); remove it to rebase onto 0.28.0 again``: advice to delete the live series;
    ``TO=0.27.0`` downloaded 0.27.0's wheel, resolved and installed both releases' dependency sets (5
    minutes), then ran the patches "onto" the older release."""
    import overlay.build.fetch

    root, _ = release
    fetched: list[str] = []
    monkeypatch.setattr(overlay.build.fetch, "fetch_wheel", lambda pin, *a, **k: fetched.append(pin.version))
    monkeypatch.setattr(overlay.build.fetch, "fetch_release", lambda v, *a, **k: fetched.append(v))
    monkeypatch.chdir(tmp_path)
    line = _one_line(capsys, ["--patches", str(root), "rebase", "--to", to])
    assert line == f"error: TO (--to) {to} " + said.format(d=root / "0.28.0")
    assert fetched == []
    assert sorted(p.name for p in (root / "0.28.0").iterdir()) == ["fix-a.patch", "pin.toml", "series"]
    assert not (tmp_path / ".work").exists()


def test_release_order() -> None:
    """The order the refusal above reads: release candidates before the release, post releases after."""
    from overlay.build.pins import release_order

    got = sorted(["0.29.0.post1", "0.29.0", "0.29.0rc1", "0.28.0", "0.10.0", "0.9.9"], key=release_order)
    assert got == ["0.9.9", "0.10.0", "0.28.0", "0.29.0rc1", "0.29.0", "0.29.0.post1"]


# --- an empty series -------------------------------------------------------------------------------------

EMPTY_SERIES = "# Patch series for vLLM 0.28.0, applied in this order by `make build`.\n\n# (none)\n"


def test_an_empty_series_is_refused_not_built(capsys: pytest.CaptureFixture[str], release: tuple[Path, Path],
                                              tmp_path: Path) -> None:
    """Before: a ``series`` of only comments built ``vllm-0.28.0+ovl04fd1c0a17`` (``0 patch(es)``), the
    unpatched wheel under an overlay version, installed it with ``--install``, exit 0
    (``test_build.py::test_empty_series_builds`` held that). For a pinned release an empty series is a lost
    file or a bad merge: refused, naming the file; the image and device-stage name their wheel through the
    same ``series_wheel`` and refuse it too."""
    root, wheel = release
    series = root / "0.28.0" / "series"
    series.write_text(EMPTY_SERIES)
    venv = tmp_path / "venv"
    line = _one_line(capsys, [*_build(root, wheel, tmp_path / "dist"), "--install", str(venv)])
    assert line == (f"error: {series}: lists no patch (only blank lines and comments): its wheel would be vLLM "
                    "0.28.0 unpatched under an overlay version (for that, install vllm==0.28.0); list the patches "
                    "there, one file name a line")
    assert not (tmp_path / "dist").exists() and not venv.exists()


def test_a_rebase_of_an_empty_series_is_refused_before_any_download(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, release: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    """Before: both wheels fetched and both dependency sets installed, then ``patches/0.29.0/`` written with an
    empty series and a report of nothing, exit 0."""
    import overlay.build.fetch

    root, _ = release
    (root / "0.28.0" / "series").write_text(EMPTY_SERIES)
    fetched: list[str] = []
    monkeypatch.setattr(overlay.build.fetch, "fetch_wheel", lambda pin, *a, **k: fetched.append(pin.version))
    monkeypatch.setattr(overlay.build.fetch, "fetch_release", lambda v, *a, **k: fetched.append(v))
    monkeypatch.chdir(tmp_path)
    line = _one_line(capsys, ["--patches", str(root), "rebase", "--to", "0.29.0"])
    assert line.endswith("series: lists no patch (only blank lines and comments): there is nothing to carry onto "
                         "0.29.0; list the patches there, one file name a line")
    assert fetched == [] and not (root / "0.29.0").exists()


# --- empty values ----------------------------------------------------------------------------------------

def _value_actions() -> list[tuple[str, argparse.Action]]:
    """(verb flag, action) for every option and positional of every verb that takes a value."""
    from overlay import cli

    found: list[tuple[str, argparse.Action]] = []

    def walk(parser: argparse.ArgumentParser, verb: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{verb} {name}".strip())
            elif action.nargs != 0:
                found.append((f"{verb} {'/'.join(action.option_strings) or action.dest}".strip(), action))

    walk(cli.parser(), "")
    return found


@pytest.mark.parametrize("text", ["", " ", "\t"], ids=["empty", "space", "tab"])
def test_no_option_takes_an_empty_value(text: str) -> None:
    """Before: every option without a checking type took ``''`` (and ``' '``): ``--dist ''`` is ``Path('')``,
    the current folder, so ``make``-style ``--dist "$DIST"`` with DIST unset wrote the wheel and its lock
    into the repository root; ``--patches ''``, ``--install ''``, ``--out ''``, ``--dest ''``,
    ``regress-verdicts ''`` the same, ``--vllm ''`` looked for ``patches/pin.toml``. Now every option and
    positional of every verb refuses it at parse time, except where ``''`` is the option's own default
    (``image --max-jobs``, ``--negative``, ``kernel-sources --mirror``, cherry-pick's REF: "needs REF")."""
    took = []
    for where, action in _value_actions():
        if action.default == "":
            continue
        try:
            (action.type or str)(text)
        except (argparse.ArgumentTypeError, TypeError, ValueError):  # what argparse takes as a refusal
            continue
        took.append(where)
    assert took == [], f"these take {text!r}: {', '.join(took)}"


def test_dist_empty_writes_nothing_in_the_current_folder(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          release: tuple[Path, Path], tmp_path: Path) -> None:
    """Before: ``overlay build --dist ''`` wrote ``vllm-0.28.0+ovl...whl`` and ``.overlay-build.lock`` into the
    current folder (the repository root under make), exit 0."""
    root, wheel = release
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(SystemExit) as exc:
        main(["--patches", str(root), "build", "--dist", "", "--base-wheel", str(wheel)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.splitlines()[-1] == (
        "overlay build: error: argument --dist: expected a value, got '': empty (an unset variable?); leave the "
        "option out for its default")
    assert list(here.iterdir()) == []


def test_an_empty_ref_still_says_cherry_pick_needs_it(capsys: pytest.CaptureFixture[str]) -> None:
    """``make cherry-pick`` passes ``-- "$REF"``: unset, it is ``''``, which keeps its own line (exit 1; 2 is
    "stopped at a conflict")."""
    assert main(["cherry-pick", ""]) == 1
    assert capsys.readouterr().err == "error: cherry-pick needs REF (a PR number, a commit or a patch file)\n"


PROFILE = Path(__file__).resolve().parent.parent / "overlay" / "regress" / "profiles" / "glm5.2-fp8-tp8-dcp8.yaml"


@pytest.mark.parametrize(("path", "value", "said"), [
    pytest.param(("server", "model"), "", "server.model: empty", id="model"),
    pytest.param(("server", "host"), " ", "server.host: only whitespace (leave it out for '127.0.0.1')", id="host"),
    pytest.param(("server", "vllm_bin"), "", "server.vllm_bin: empty (leave it out for 'vllm')", id="vllm-bin"),
    pytest.param(("gsm8k", "data"), "", "gsm8k.data: empty", id="gsm8k-data"),
    pytest.param(("thresholds", "gsm8k_max_stderrs", "why"), "  ", "thresholds.gsm8k_max_stderrs.why: only "
                 "whitespace", id="threshold-why"),
    pytest.param(("baseline", "source"), "", "baseline.source: empty", id="baseline-source"),
])
def test_a_profile_string_that_is_empty_is_refused(path: tuple[str, ...], value: str, said: str) -> None:
    """Before: taken. ``server.model: ""`` made the command ``vllm serve ''``;
    ``gsm8k.data: ""`` is the current folder; a threshold's ``why: " "`` passed the rule that every
    threshold says why; ``baseline.source: ""`` named no source."""
    import yaml

    from overlay.regress.errors import ProfileError
    from overlay.regress.profiles import parse_profile

    data = yaml.safe_load(PROFILE.read_text())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ProfileError) as exc:
        parse_profile(yaml.safe_dump(data), "p.yaml")
    assert str(exc.value) == f"p.yaml: {said}"


# --- a patch that does not apply: the base, or an earlier patch ------------------------------------------

def _line5(tmp_path: Path, value: str, subject: str) -> bytes:
    from tests.wheelkit import A_PY, changed, format_patch

    after = changed(A_PY, b"line_5 = 5\n", f"line_5 = {value}\n".encode())
    return format_patch({"vllm/a.py": A_PY}, {"vllm/a.py": after}, subject, work=tmp_path)


@pytest.mark.parametrize(("second", "said"), [
    pytest.param("50", "the earlier patch fix-a.patch already made this change (fix-b.patch applies to vllm 0.28.0 "
                 "alone): take the change out of one of them", id="the-same-change"),
    pytest.param("51", "the earlier patch fix-a.patch changes the same lines (fix-b.patch applies to vllm 0.28.0 "
                 "alone): refresh fix-b.patch on top of it (make workspace)", id="another-change-of-those-lines"),
])
def test_a_patch_an_earlier_patch_got_in_the_way_of_names_that_patch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, second: str, said: str,
) -> None:
    """Before: ``patch fix-b.patch: vllm/a.py: hunk #1 (@@ -3,7 at fix-b.patch:15) does not apply to vllm
    0.28.0``, though it applies to vllm 0.28.0: the earlier ``fix-a.patch`` made the change first (or
    changed those lines another way), and nothing said so."""
    (tmp_path / "base").mkdir()
    wheel = make_wheel(tmp_path / "base", BASE_FILES)
    root = make_release(tmp_path, wheel, patches={"fix-a.patch": _line5(tmp_path, "50", "Line 5 is 50"),
                                                  "fix-b.patch": _line5(tmp_path, second, "Line 5 again")})
    line = _one_line(capsys, _build(root, wheel, tmp_path / "dist"))
    assert line == ("error: patch fix-b.patch: vllm/a.py: hunk #1 (@@ -3,7 at fix-b.patch:15) does not apply to "
                    f"vllm 0.28.0; {said}")
    assert not (tmp_path / "dist").exists()


def test_a_patch_the_base_already_has_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Before: ``... does not apply to vllm 0.28.0``, with nothing to tell a change upstream already has from
    drifted context."""
    from tests.wheelkit import A_PY, changed

    (tmp_path / "base").mkdir()
    wheel = make_wheel(tmp_path / "base", {**BASE_FILES, "vllm/a.py": changed(A_PY, b"line_5 = 5\n", b"line_5 = 50\n")})
    root = make_release(tmp_path, wheel, patches={"fix-a.patch": _line5(tmp_path, "50", "Line 5 is 50")})
    line = _one_line(capsys, _build(root, wheel, tmp_path / "dist"))
    assert line.endswith("does not apply to vllm 0.28.0; vllm 0.28.0 already has this change (fix-a.patch reverses "
                         "cleanly on it): take fix-a.patch out of the series"), line


def test_a_key_given_twice_in_a_profile_is_refused(tmp_path: Path) -> None:
    """Before: PyYAML kept the last of two keys without a word: a second ``thresholds:`` block (a paste
    at the end of the file) replaced the whole first one."""
    from overlay.regress.errors import ProfileError
    from overlay.regress.profiles import load_profile

    text = PROFILE.read_text()
    profile = tmp_path / "twice.yaml"
    profile.write_text(text + "\nthresholds: {}\n")
    first = text[:text.index("\nthresholds:")].count("\n") + 2
    last = text.count("\n") + 2
    with pytest.raises(ProfileError) as exc:
        load_profile(str(profile))
    assert str(exc.value) == (f"{profile}: line {last} not valid YAML: 'thresholds' is given twice (first on line "
                              f"{first}); keep one")


@pytest.mark.parametrize(("releases", "series", "said"), [
    pytest.param(["0.29.0", "0.30.0", "0.29.0"], None, "--releases: 0.29.0 given twice (each would be fetched and "
                 "run twice)", id="a-release-twice"),
    pytest.param(["0.29.0"], EMPTY_SERIES, "series: lists no patch (only blank lines and comments): the matrix would "
                 "have no row; list the patches there, one file name a line", id="empty-series"),
])
def test_a_patch_tests_matrix_that_cannot_mean_it_is_refused_before_any_download(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, release: tuple[Path, Path],
    tmp_path: Path, releases: list[str], series: str | None, said: str,
) -> None:
    """Before: each release's tree fetched and its dependency set installed, then a release given twice run
    twice (two columns of one name), an empty series run as a table of no row, exit 0."""
    import overlay.maintain.trees

    root, _ = release
    if series is not None:
        (root / "0.28.0" / "series").write_text(series)
    (tmp_path / "tests" / "patches").mkdir(parents=True)
    fetched: list[str] = []
    monkeypatch.setattr(overlay.maintain.trees, "release_tree", lambda v, *a, **k: fetched.append(v))
    monkeypatch.chdir(tmp_path)
    line = _one_line(capsys, ["--patches", str(root), "patch-tests-matrix", "--releases", *releases,
                              "--tests", "tests/patches"])
    assert line.endswith(said), line
    assert fetched == [] and not (tmp_path / "patch-tests-matrix").exists()


@pytest.mark.parametrize(("file", "text", "said"), [
    pytest.param("fix-a.patch", "", "is empty, not a git format-patch file", id="patch"),
    pytest.param("pin.toml", "\n\n", "is empty (only whitespace), not a pin (version, wheel, sha256)", id="pin"),
])
def test_an_empty_patch_or_pin_says_it_is_empty(capsys: pytest.CaptureFixture[str], release: tuple[Path, Path],
                                                tmp_path: Path, file: str, text: str, said: str) -> None:
    """Before: an empty patch (a failed export) was ``not a git format-patch file (no 'From ' line)``; an
    empty ``pin.toml`` ``missing field 'version'; missing field 'wheel'; missing field 'sha256'``."""
    root, wheel = release
    path = root / "0.28.0" / file
    path.write_text(text)
    assert _one_line(capsys, _build(root, wheel, tmp_path / "dist")) == f"error: {path}: {said}"


def test_an_empty_profile_says_it_is_empty(tmp_path: Path) -> None:
    """Before: ``P: expected a mapping at the top level``."""
    from overlay.regress.errors import ProfileError
    from overlay.regress.profiles import load_profile

    profile = tmp_path / "empty.yaml"
    profile.write_text("")
    with pytest.raises(ProfileError, match=r": is empty, not a profile \(name, server, checks, \.\.\.\)$"):
        load_profile(str(profile))
