"""Install a built wheel into a virtual environment (``.venv`` by default), safely and fast.

The environment holds the torch the release pins (its wheel's ``Requires-Dist: torch==X``, also written
as ``torch`` in its ``pin.toml``), vLLM's other requirements, and the wheel itself. torchvision,
torchaudio and torchcodec are left out: they are not needed to import vLLM's modules, and PyPI's CUDA
builds of them break ``import vllm`` beside a CPU torch (docs/ARCHITECTURE.md, "Pins"); on a GPU
machine the wheel installs with a plain ``pip install``. One environment holds one release's torch:
a wheel whose pin differs from the torch an environment already has is refused
(:func:`torch_mismatch`), never swapped in under the other release's installs.

The wheel never goes into the live environment piece by piece: it is staged next to it and
swapped in (:mod:`overlay.build.swap`), so a kill leaves the old or the new vLLM importable and the
next install finishes or drops what was left. Two ways to stage:

- incremental (after a rebuild of the same base: same requirements, same entry points): the
  unchanged files of the installed distribution are hard-linked, only the members whose RECORD
  hash changed are written and byte-compiled, and the dist-info is written the way pip writes it
  (INSTALLER, REQUESTED, direct_url.json, RECORD with the ``.pyc`` rows and the rehashed
  script), so the result is what ``pip install`` of the wheel gives;
- pip (first install, changed requirements, an installed distribution that is not whole):
  requirements with pip into the environment as before, then the wheel with
  ``pip install --root <stage>``.
"""

from __future__ import annotations

import csv
import io
import json
import os
import py_compile
import shutil
import stat
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
import venv
import zipfile
from dataclasses import dataclass
from importlib.util import cache_from_source
from pathlib import Path

from packaging.markers import default_environment
from packaging.metadata import parse_email
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from overlay import digest, lock
from overlay.atomic import child_tmpdir
from overlay.atomic import umask as current_umask
from overlay.build import swap
from overlay.build.stand_ins import swap_all
from overlay.build.wheel import dist_info_name, read_record, record_hash
from overlay.errors import OverlayError, PinError
from overlay.interrupt import bound_to_parent

# CUDA-only builds on PyPI that fail to import beside the CPU torch (docs/ARCHITECTURE.md, "Pins").
CPU_SKIP = frozenset({"torchvision", "torchaudio", "torchcodec"})
DIST = "vllm"
LOCK_NAME = ".overlay-install.lock"
# Installed files up to this size are checked by hash before they are reused; larger ones
# (the compiled libraries) by size, as pip writes a file whole or leaves it short.
HASH_CHECK_MAX = 1 << 20


class InstallError(OverlayError):
    """pip failed while installing into the environment, or the environment cannot take the wheel."""


@dataclass(frozen=True)
class InstallResult:
    """How the wheel went in: ``incremental``, ``pip`` or ``unchanged``; and why for ``pip``."""

    python: Path
    how: str
    reason: str = ""
    written: int = 0  # files written (incremental: changed members, dist-info, .pyc)


def _requires_dist(wheel: Path, python_version: str = "") -> list[Requirement]:
    """The wheel's ``Requires-Dist`` whose markers hold on this machine (or on it with Python
    ``python_version``, e.g. ``3.11``), extras left out."""
    with zipfile.ZipFile(wheel) as zf:
        dist_info = dist_info_name(zf.infolist(), wheel)
        metadata = zf.read(f"{dist_info}/METADATA")
    raw, _ = parse_email(metadata)
    env = {**default_environment(), "extra": ""}
    if python_version:
        env.update(python_version=python_version, python_full_version=f"{python_version}.0")
    reqs = map(Requirement, raw.get("requires_dist", []))
    return [req for req in reqs if req.marker is None or req.marker.evaluate(env)]


def requirements(wheel: Path, *, python_version: str = "", skip: frozenset[str] = CPU_SKIP) -> list[str]:
    """The wheel's ``Requires-Dist`` for this machine (or Python ``python_version``), without extras
    and without the canonical names in ``skip`` (:data:`CPU_SKIP`)."""
    return [str(req) for req in _requires_dist(wheel, python_version) if canonicalize_name(req.name) not in skip]


def torch_pin(wheel: Path) -> str | None:
    """The torch version the wheel pins exactly (``torch==X``), else None."""
    for req in _requires_dist(wheel):
        if canonicalize_name(req.name) == "torch":
            pinned = [s.version for s in req.specifier if s.operator == "=="]
            return pinned[0] if len(pinned) == 1 else None
    return None


def check_torch_pin(pin_torch: str | None, wheel: Path, source: str) -> None:
    """A :class:`~overlay.errors.PinError` naming ``source`` (the pin file) when its ``torch`` field is
    missing or differs from the torch the wheel itself pins."""
    pinned = torch_pin(wheel)
    if pinned is not None and pin_torch != pinned:
        have = f"is {pin_torch!r}" if pin_torch else "is missing"
        raise PinError(f"{source}: field 'torch' {have}, but {wheel.name} pins torch=={pinned}: "
                       f"write torch = \"{pinned}\" there")


def installed_torch(python: Path) -> str | None:
    """The torch version installed in the environment of ``python`` (local label dropped), else None."""
    code = ("import importlib.metadata as m\ntry: print(m.version('torch'))\n"
            "except m.PackageNotFoundError: print('')")
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    found = proc.stdout.strip() if proc.returncode == 0 else ""
    return found.split("+", 1)[0] or None


def torch_mismatch(wheel: Path, env_dir: Path) -> str | None:
    """Why ``wheel`` cannot go into ``env_dir``, or None when it can: the environment already holds
    another torch than the wheel pins (one environment, one release's torch)."""
    python = env_dir / "bin" / "python"
    pinned = torch_pin(wheel)
    if pinned is None or not python.exists():
        return None
    have = installed_torch(python)
    if have is None or have == pinned:
        return None
    return f"it pins torch=={pinned}, and {env_dir} holds torch {have} (another release's)"


def installed_mismatch(release: str | None) -> str | None:
    """Why the vLLM this environment imports is not a build of ``release`` (a tool that judges the installed
    build was asked for that release: bench-merge, upstream-tests), or None; None for no ``release``."""
    from importlib.metadata import PackageNotFoundError, version

    if release is None:
        return None
    try:
        have = version("vllm")
    except PackageNotFoundError:
        return f"--vllm {release}: no vLLM is installed here; install its build (make build VLLM={release})"
    if have.split("+", 1)[0] != release:
        return f"--vllm {release}: the installed vLLM is {have}; install {release}'s build (make build VLLM={release})"
    if "+" not in have:
        return f"--vllm {release}: the installed vLLM {have} is unpatched: not the series' build"
    return None


def _pip(python: Path, args: list[str], *, bound: bool = False) -> None:
    quiet = [] if sys.stderr.isatty() else ["-q"]
    with child_tmpdir() as env:  # a killed install's pip-* temporaries: swept by the next run
        proc = subprocess.run([str(python), "-m", "pip", *args, *quiet], check=False, env=env,
                              preexec_fn=bound_to_parent() if bound else None)
    if proc.returncode != 0:
        raise InstallError(f"pip {' '.join(args[:2])} ... failed ({proc.returncode}) in {python.parent.parent}")


def _env_paths(python: Path) -> tuple[Path, Path]:
    """The environment's site-packages (platlib, where pip puts vLLM) and scripts folder."""
    code = "import json, sysconfig; print(json.dumps([sysconfig.get_path('platlib'), sysconfig.get_path('scripts')]))"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise InstallError(f"{python}: does not run ({proc.stderr.strip().splitlines()[-1:] or proc.returncode}): "
                           f"remove {python.parent.parent} and build again")
    site, scripts = json.loads(proc.stdout)
    return Path(site), Path(scripts)


def install(wheel: Path, env_dir: Path, *, with_deps: bool = True) -> InstallResult:
    """Create ``env_dir`` when missing and install ``wheel`` (and, on the pip path, its requirements)."""
    if env_dir.exists() and not env_dir.is_dir():
        raise InstallError(f"{env_dir}: is a file, not an environment: move it away or pass another --install")
    python = env_dir / "bin" / "python"
    if not python.exists():
        print(f"creating {env_dir} ...", file=sys.stderr, flush=True)
        venv.EnvBuilder(with_pip=True).create(env_dir)
    with lock.held(env_dir / LOCK_NAME, f"another install into {env_dir}"):
        site, scripts = _env_paths(python)
        try:
            said = swap.recover(site, DIST)
        except OSError as exc:
            raise InstallError(f"{swap.stage_dir(site)}: cannot finish an interrupted install ({exc}): "
                               "remove it and build again") from exc
        if said:
            print(said, file=sys.stderr, flush=True)
        try:
            return _install(wheel, python, site, scripts, with_deps=with_deps)
        except OSError as exc:
            raise InstallError(f"{exc.filename or site}: cannot install {wheel.name} ({exc.strerror or exc}): "
                               f"check {site}, then build again") from exc


def _install(wheel: Path, python: Path, site: Path, scripts: Path, *, with_deps: bool) -> InstallResult:
    wheel_hash = _Digest(wheel)  # the wheel's sha256 (direct_url.json) is computed beside the staging
    with zipfile.ZipFile(wheel) as zf:
        new = _WheelView.read(zf, wheel)
        old, why = _installed(site, zf, new)
        if old is not None:
            stage = swap.new_stage(site)
            try:
                plan, written = _stage_incremental(zf, new, old, site, scripts, stage, wheel, wheel_hash)
            except BaseException:
                shutil.rmtree(stage, ignore_errors=True)
                raise
            if plan is None:
                swap.discard(stage)
                return InstallResult(python, "unchanged")
            swap.seal(stage, plan)
            swap.commit(site, stage, plan, DIST)
            return InstallResult(python, "incremental", written=written)
    print(f"installing with pip: {why}", file=sys.stderr, flush=True)
    if with_deps:
        reqs, swapped = swap_all(requirements(wheel))
        for line in swapped:  # an exact pin the index does not serve: its stand-in, said
            print(f"installing requirements: {line}", file=sys.stderr, flush=True)
        torch = [r for r in reqs if canonicalize_name(Requirement(r).name) == "torch"]
        print(f"installing requirements ({', '.join(torch) or 'torch'} and vLLM's dependencies) ...",
              file=sys.stderr, flush=True)
        if torch:  # first alone: its own download is the largest, and a failure here names it
            _pip(python, ["install", "--disable-pip-version-check", *torch])
        _pip(python, ["install", "--disable-pip-version-check", *reqs])
    print(f"installing {wheel.name} ...", file=sys.stderr, flush=True)
    stage = swap.new_stage(site)
    try:
        plan = _stage_with_pip(python, wheel, site, stage)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    swap.seal(stage, plan)
    swap.commit(site, stage, plan, DIST)
    return InstallResult(python, "pip", reason=why)


class _Digest:
    """sha256 of a file, computed in a thread (hashlib lets go of the GIL on large blocks)."""

    def __init__(self, path: Path) -> None:
        self._hex = ""
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(path,), daemon=True)
        self._thread.start()

    def _run(self, path: Path) -> None:
        try:
            self._hex = digest.of_file(path)
        except BaseException as exc:  # handed to the caller of hexdigest()
            self._error = exc

    def hexdigest(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hex


@dataclass(frozen=True)
class _WheelView:
    """What the incremental path needs of the new wheel."""

    dist_info: str
    record: dict[str, tuple[str, int]]  # member -> (hash, size), RECORD itself left out
    record_rows: list[tuple[str, str, str]]  # RECORD as written in the wheel
    tops: frozenset[str]
    infos: dict[str, zipfile.ZipInfo]

    @classmethod
    def read(cls, zf: zipfile.ZipFile, wheel: Path) -> _WheelView:
        infos = {i.filename: i for i in zf.infolist() if not i.filename.endswith("/")}
        dist_info = dist_info_name(list(infos.values()), wheel)
        record = read_record(zf, dist_info, wheel)
        rows = [(r[0], r[1] if len(r) > 1 else "", r[2] if len(r) > 2 else "")
                for r in csv.reader(zf.read(f"{dist_info}/RECORD").decode().splitlines()) if r]
        tops = frozenset(n.split("/", 1)[0] for n in infos if not n.startswith(dist_info + "/"))
        return cls(dist_info, record, rows, tops, infos)

    def text(self, zf: zipfile.ZipFile, name: str) -> bytes:
        return zf.read(f"{self.dist_info}/{name}")


@dataclass(frozen=True)
class _Installed:
    """The installed distribution: its dist-info folder and RECORD (``path -> (hash, size)``)."""

    dist_info: str
    record: dict[str, tuple[str, str]]


def _installed(site: Path, zf: zipfile.ZipFile, new: _WheelView) -> tuple[_Installed | None, str]:
    """The installed distribution when the incremental path can build on it; else None and why not."""
    infos = sorted(p.name for p in site.glob(f"{DIST}-*.dist-info"))
    if not infos:
        if (site / DIST).exists():
            return None, f"{site / DIST} has no dist-info folder (an interrupted install): reinstalling it whole"
        return None, f"no {DIST} in {site} yet"
    if len(infos) > 1:
        return None, f"{site} holds {len(infos)} dist-info folders of {DIST} ({', '.join(infos)}): reinstalling"
    dist_info = site / infos[0]
    try:
        text = (dist_info / "RECORD").read_text(encoding="utf-8")
        meta = (dist_info / "METADATA").read_bytes()
        eps = (dist_info / "entry_points.txt").read_bytes() if (dist_info / "entry_points.txt").exists() else b""
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{dist_info} is not whole ({exc}): reinstalling"
    record = {r[0]: (r[1] if len(r) > 1 else "", r[2] if len(r) > 2 else "")
              for r in csv.reader(text.splitlines()) if r}
    if any(n.split("/", 1)[0].endswith(".data") for n in new.infos):
        return None, f"{new.dist_info}: the wheel has a .data folder"
    old_tops = {p.split("/", 1)[0] for p in record if not p.startswith("../")} - {infos[0]}
    if old_tops != set(new.tops):
        return None, f"the wheel's top-level entries {sorted(new.tops)} differ from the installed {sorted(old_tops)}"
    if _requires(meta) != _requires(new.text(zf, "METADATA")):
        return None, "the requirements changed"
    new_eps = new.text(zf, "entry_points.txt") if f"{new.dist_info}/entry_points.txt" in new.infos else b""
    if eps != new_eps:
        return None, "the entry points changed"
    missing = [p for p in record if p.startswith("../") and not (site / p).is_file()]
    if missing:
        return None, f"{os.path.normpath(site / missing[0])} is missing: reinstalling"
    return _Installed(infos[0], record), ""


def _requires(metadata: bytes) -> tuple[list[str], list[str]]:
    raw, _ = parse_email(metadata)
    return list(raw.get("requires_dist", [])), [str(raw.get("requires_python", ""))]


def _intact(path: Path | str, hash_: str, size: str, record_mtime_ns: int = 0) -> bool:
    """Whether an installed file still is what RECORD says.

    By size, plus: a file not modified since RECORD was written (installers write RECORD last) is
    trusted; a newer one is hashed when it is at most HASH_CHECK_MAX (an edit by hand), so only
    touched files cost a read.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or not size or st.st_size != int(size):
        return False
    if st.st_size > HASH_CHECK_MAX or st.st_mtime_ns <= record_mtime_ns:
        return True
    with open(path, "rb") as fh:
        return record_hash(fh.read()) == hash_


def _file_mode(info: zipfile.ZipInfo, umask: int) -> int:
    """The mode pip gives an extracted file: the default, plus x when the archive says executable."""
    mode = info.external_attr >> 16
    if mode and stat.S_ISREG(mode) and mode & 0o111:
        return 0o777 & ~umask | 0o111
    return 0o666 & ~umask


def _stage_incremental(zf: zipfile.ZipFile, new: _WheelView, old: _Installed, site: Path, scripts: Path,
                       stage: Path, wheel: Path, wheel_hash: _Digest) -> tuple[swap.Plan | None, int]:
    """Stage the new distribution from the installed one plus the changed members; None when nothing changed."""
    umask = current_umask()
    written = 0
    made: set[str] = set()  # plain strings in this loop over ~7000 files: pathlib costs more than the links

    def parent(path: Path | str) -> None:
        folder = os.path.dirname(path)
        if folder not in made:
            os.makedirs(folder, exist_ok=True)
            made.add(folder)

    def extract(name: str, dest: Path) -> None:
        nonlocal written
        parent(dest)
        with zf.open(new.infos[name]) as src, open(dest, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        os.chmod(dest, _file_mode(new.infos[name], umask))
        written += 1

    record_mtime_ns = os.stat(site / old.dist_info / "RECORD").st_mtime_ns
    site_s, stage_s = os.fspath(site), os.fspath(stage)
    info_prefix = new.dist_info + "/"
    # Decide first, stage after: an unchanged wheel costs ~7000 stats, not ~7000 links into a stage.
    link: list[str] = []  # installed files (and their .pyc when installed) taken as they are
    extract_these: list[str] = []
    compile_these: list[str] = []
    for name, (hash_, _size) in new.record.items():
        if name.startswith(info_prefix):
            continue
        old_row = old.record.get(name)
        if old_row is not None and old_row[0] == hash_ and \
                _intact(os.path.join(site_s, name), hash_, old_row[1], record_mtime_ns):
            link.append(name)
            if name.endswith(".py"):
                pyc = cache_from_source(name)
                if pyc in old.record and os.path.isfile(os.path.join(site_s, pyc)):
                    link.append(pyc)
                else:
                    compile_these.append(name)
        else:
            extract_these.append(name)
            if name.endswith(".py"):
                compile_these.append(name)
    direct_url = _direct_url(wheel, wheel_hash.hexdigest())
    if not extract_these and not compile_these and new.dist_info == old.dist_info and \
            _read_or_none(site / old.dist_info / "direct_url.json") == direct_url:
        return None, 0
    for name in link:
        dest = os.path.join(stage_s, name)
        parent(dest)
        os.link(os.path.join(site_s, name), dest)
    for name in extract_these:
        extract(name, Path(stage_s, name))
    for name in compile_these:
        if _compile(stage / name, stage / cache_from_source(name), site / name):
            written += 1
    info_dir = stage / new.dist_info
    for name in new.infos:
        if name.startswith(new.dist_info + "/") and name != f"{new.dist_info}/RECORD":
            extract(name, stage / name)
    generated = [info_dir / "INSTALLER", info_dir / "direct_url.json", info_dir / "REQUESTED"]
    for path, data in zip(generated, (b"pip\n", direct_url, b""), strict=True):
        path.write_bytes(data)
        os.chmod(path, 0o666 & ~umask)
    rows = list(new.record_rows)
    rows += [(cache_from_source(n), "", "") for n in new.record
             if n.endswith(".py") and (stage / cache_from_source(n)).is_file()]
    for path in generated:
        data = path.read_bytes()
        rows.append((f"{new.dist_info}/{path.name}", record_hash(data), str(len(data))))
    for rel in sorted(p for p in old.record if p.startswith("../")):  # scripts: kept, rehashed as pip does
        data = (site / rel).read_bytes()
        rows.append((rel, record_hash(data), str(len(data))))
    buf = io.StringIO(newline="")
    csv.writer(buf).writerows(sorted(rows))
    (info_dir / "RECORD").write_text(buf.getvalue(), encoding="utf-8", newline="")
    os.chmod(info_dir / "RECORD", 0o666 & ~umask)
    written += len(generated) + 1
    entries = [*sorted(new.tops), new.dist_info]
    remove = [old.dist_info] if old.dist_info != new.dist_info else []
    return swap.Plan(entries=entries, inodes={}, remove=remove), written


def _compile(src: Path, pyc: Path, final: Path) -> bool:
    """Byte-compile as pip does after an install (``compileall.compile_file``, force); False on a syntax error."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            py_compile.compile(str(src), cfile=str(pyc), dfile=str(final), doraise=True)
    except py_compile.PyCompileError:
        return False
    return True


def _direct_url(wheel: Path, sha256: str) -> bytes:
    """``direct_url.json`` as pip writes it for a wheel file given by path (PEP 610)."""
    url = urllib.parse.urljoin("file:", urllib.request.pathname2url(os.path.normpath(os.path.abspath(wheel))))
    doc = {"archive_info": {"hash": f"sha256={sha256}", "hashes": {"sha256": sha256}}, "url": url}
    return json.dumps(doc, sort_keys=True).encode()


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _stage_with_pip(python: Path, wheel: Path, site: Path, stage: Path) -> swap.Plan:
    """``pip install --root`` into the stage, then lay the result out as a stage for :func:`swap.commit`."""
    root = stage / "root"
    _pip(python, ["install", "--disable-pip-version-check", "--no-deps", "--ignore-installed",
                  "--no-warn-script-location", "--root", str(root), str(wheel)], bound=True)
    root_site = root / site.relative_to(site.anchor)
    if not root_site.is_dir():
        raise InstallError(f"{root}: pip did not install into {site} under it: install {wheel} with pip by hand")
    entries = sorted((p.name for p in root_site.iterdir()), key=lambda n: (n.endswith(".dist-info"), n))
    for name in entries:
        os.rename(root_site / name, stage / name)
    files: dict[str, str] = {}
    (stage / "files").mkdir()
    for i, path in enumerate(sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink())):
        os.rename(path, stage / "files" / str(i))
        files[str(i)] = str(Path(site.anchor) / path.relative_to(root))
    old = sorted(p.name for p in site.glob(f"{DIST}-*.dist-info"))
    return swap.Plan(entries=entries, inodes={}, files=files, remove=old + _old_tops(site, old, entries))


def _old_tops(site: Path, dist_infos: list[str], keep: list[str]) -> list[str]:
    """Top-level entries the installed distribution(s) own that the new one does not."""
    tops: set[str] = set()
    for name in dist_infos:
        try:
            text = (site / name / "RECORD").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        tops |= {r[0].split("/", 1)[0] for r in csv.reader(text.splitlines()) if r and not r[0].startswith("../")}
    return sorted(tops - set(keep) - set(dist_infos) - {"", ".", ".."})

