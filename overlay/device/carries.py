"""Carries: the staged files split into pieces and packed into folders of at most the carry limit,
each with a copy of the manifest (and of the small files that travel beside it); the device calls that
bring them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from overlay import digest
from overlay.atomic import replacing_dir
from overlay.device.files import StagedFile
from overlay.device.settings import CALL_LIMIT, CARRY_LIMIT, MANIFEST_RESERVE, MIB, DeviceStageError


@dataclass(frozen=True)
class Piece:
    """A file, or one part of a file split because it is larger than a carry."""

    path: str  # inside the carry: the file's path, or <path>.part-NN
    file: str  # the staged file's path
    offset: int
    size: int
    part: int | None = None


def split_pieces(files: Sequence[tuple[str, int]], part_size: int) -> list[Piece]:
    """Files as pieces: a file larger than ``part_size`` becomes ``.part-00``, ``.part-01``, ..."""
    pieces = []
    for path, size in files:
        if size <= part_size:
            pieces.append(Piece(path, path, 0, size))
            continue
        count = -(-size // part_size)
        width = max(2, len(str(count - 1)))
        for i in range(count):
            off = i * part_size
            pieces.append(Piece(f"{path}.part-{i:0{width}d}", path, off, min(part_size, size - off), i))
    return pieces


def pack(pieces: Sequence[Piece], capacity: int) -> list[list[Piece]]:
    """First-fit decreasing (size, then path) into bins of ``capacity`` bytes; each bin sorted by path."""
    bins: list[list[Piece]] = []
    room: list[int] = []
    for piece in sorted(pieces, key=lambda p: (-p.size, p.path)):
        if piece.size > capacity:
            raise DeviceStageError(f"{piece.path}: {piece.size} bytes do not fit a carry of {capacity}")
        slot = next((i for i, r in enumerate(room) if r >= piece.size), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(piece)
        room[slot] -= piece.size
    return [sorted(b, key=lambda p: p.path) for b in bins]


def carry_name(index: int) -> str:
    return f"carry-{index:02d}"


def build_manifest(name: str, files: Sequence[StagedFile], carries: Sequence[Sequence[Piece]],
                   limit: int, extra: Mapping[str, object]) -> dict:
    """The manifest: every file (sha256, size, kind, target, parts), every carry's pieces, and ``extra``."""
    by_path = {f.path: f for f in files}
    sha_of: dict[str, str] = {}
    for pieces in carries:
        for p in pieces:
            sha_of[p.path] = by_path[p.file].sha256 if p.part is None else _piece_sha(by_path[p.file], p)
    parts: dict[str, list[str]] = {}
    for p in sorted((p for c in carries for p in c if p.part is not None), key=lambda p: (p.file, p.part)):
        parts.setdefault(p.file, []).append(p.path)
    return {
        "format": 1,
        "name": name,
        "limit_bytes": limit,
        "files": [
            {"path": f.path, "kind": f.kind, "size": f.size, "sha256": f.sha256,
             **({"target": f.target, "target_sha256": f.target_sha256} if f.target else {}),
             **({"parts": parts[f.path]} if f.path in parts else {})}
            for f in sorted(files, key=lambda f: f.path)
        ],
        "carries": [
            {"name": carry_name(i), "size": sum(p.size for p in pieces),
             "pieces": [{"path": p.path, "file": p.file, "size": p.size, "sha256": sha_of[p.path],
                         **({"part": p.part} if p.part is not None else {})} for p in pieces]}
            for i, pieces in enumerate(carries, 1)
        ],
        **extra,
    }


def _piece_sha(file: StagedFile, piece: Piece) -> str:
    with file.source.open("rb") as fh:
        fh.seek(piece.offset)
        return digest.of_bytes(fh.read(piece.size))


def write_carries(dest: Path, name: str, files: Sequence[StagedFile], *, limit: int = CARRY_LIMIT,
                  extra: Mapping[str, object] | None = None, beside: Mapping[str, bytes] | None = None) -> dict:
    """Pack ``files`` into ``dest/carry-NN/`` (replacing ``dest``) and write the manifests; return it.

    ``beside`` (file name -> content: ``liveness.json``) travels in every carry next to the manifest, which
    records each one's sha256 and size under ``beside``."""
    paths = [f.path for f in files]
    if len(set(paths)) != len(paths):
        raise DeviceStageError("two staged files share a path")
    beside = dict(beside or {})
    extra = {**(extra or {}), **({"beside": {n: {"sha256": digest.of_bytes(data), "size": len(data)}
                                             for n, data in sorted(beside.items())}} if beside else {})}
    sized = [(f.path, f.size) for f in sorted(files, key=lambda f: f.path)]
    reserve = min(MANIFEST_RESERVE, limit // 4)
    for _ in range(8):  # the manifest travels in every carry: keep room for it, grow the room if needed
        capacity = limit - reserve - sum(len(data) for data in beside.values())
        if capacity < 1:  # split_pieces would make no piece: nothing staged, and no error
            raise DeviceStageError(f"carries of {limit} bytes leave no room beside the manifest and "
                                   f"{', '.join(beside) or 'nothing else'}: stage with a larger --limit-mib")
        carries = pack(split_pieces(sized, capacity), capacity)
        manifest = build_manifest(name, files, carries, limit, extra)
        text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
        if len(text.encode()) <= reserve:
            break
        reserve = len(text.encode()) * 9 // 8
    else:
        raise DeviceStageError(f"the manifest does not leave room in carries of {limit} bytes")
    by_path = {f.path: f for f in files}
    with replacing_dir(dest) as tmp:
        for i, pieces in enumerate(carries, 1):
            folder = tmp / carry_name(i)
            for piece in pieces:
                out = folder / piece.path
                out.parent.mkdir(parents=True, exist_ok=True)
                _copy_range(by_path[piece.file].source, out, piece.offset, piece.size)
            (folder / "manifest.json").write_text(text)
            for file, data in beside.items():
                (folder / file).write_bytes(data)
            total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            if total > limit:
                raise DeviceStageError(f"{carry_name(i)} holds {total} bytes, over the limit {limit}")
        (tmp / "manifest.json").write_text(text)
        for file, data in beside.items():
            (tmp / file).write_bytes(data)
    return manifest


def _copy_range(src: Path, dst: Path, offset: int, size: int) -> None:
    with src.open("rb") as fin, dst.open("wb") as fout:
        fin.seek(offset)
        left = size
        while left:
            chunk = fin.read(min(left, 8 * MIB))
            if not chunk:
                raise DeviceStageError(f"{src}: shorter than expected")
            fout.write(chunk)
            left -= len(chunk)


def device_calls(manifest: Mapping, dest: Path, command: str = "python3 -m pytest -m gpu tests/patches") -> str:
    """The ``run`` calls that bring every carry to the device, in order, and the command of each."""
    carries = [c["name"] for c in manifest["carries"]]
    lines = [f"device calls ({len(carries)}), back to back: files outside the repository survive on the "
             "device only while it stays warm (30 s between calls)"]
    for i, carry in enumerate(carries, 1):
        tail = f" -- {command}" if i == len(carries) else ""
        lines.append(f"  {i}/{len(carries)}  carry [\"{dest / carry}\"]  "
                     f"command: bash scripts/device-run.sh {dest}{tail}")
    lines.append(f"  then, without carries: bash scripts/device-run.sh {dest} -- COMMAND ...")
    return "\n".join(lines)






def checkout_bytes(repo: Path) -> int:
    """The bytes a device call copies besides the carry: tracked and untracked-not-ignored files."""
    from overlay.git import git_text

    names = git_text(["ls-files", "-z", "--cached", "--others", "--exclude-standard"], repo).split("\0")
    return sum((repo / n).stat().st_size for n in names if n and (repo / n).is_file())


def carry_limit(repo: Path, wanted: int = CARRY_LIMIT, margin: int = MIB) -> int:
    """``wanted``, or less when the checkout is so large that carry + checkout would pass ``CALL_LIMIT``."""
    used = checkout_bytes(repo)
    room = CALL_LIMIT - used - margin
    if room < 8 * MIB:
        raise DeviceStageError(f"{repo}: the checkout's own files take {used / MIB:.1f} MiB of "
                               f"the {CALL_LIMIT // MIB} MiB a device call carries; move large files out of git")
    return min(wanted, room)
