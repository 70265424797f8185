"""Rewrite a wheel: raw-copy untouched members, write changed ones, version, RECORD.

Untouched members are copied as their compressed bytes (no recompression), so a rebuild
of a 300 MB wheel costs about a file copy. Written members are deflated with fixed
settings and a fixed timestamp; members keep the base order, new files are added in
sorted order before the ``.dist-info`` folder, and RECORD comes last, so the same inputs
always give the same bytes.

RECORD is regenerated from what is written: hashes of written members are computed from
their bytes; hashes of raw-copied members come from the base RECORD, which is trusted
because the base wheel's own sha256 was verified against the pin before it was opened.
Every base member is cross-checked against that RECORD (present, same size).
"""

from __future__ import annotations

import base64
import contextlib
import csv
import hashlib
import io
import os
import re
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from overlay.errors import WheelError

# 1980-01-01 00:00:00, the earliest time a zip header can hold (as pypa/wheel clamps to).
_FIXED_DOS_TIME = 0
_FIXED_DOS_DATE = (0 << 9) | (1 << 5) | 1
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_UTF8_FLAG = 0x800
_ZIP64_LIMIT = 0xFFFFFFFF


def record_hash(data: bytes) -> str:
    """``sha256=<urlsafe base64, no padding>`` as RECORD wants it."""
    return _record_digest(hashlib.sha256(data))


def _record_digest(h: hashlib._Hash) -> str:
    return "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def escape_version(version: str) -> str:
    """Version as it appears in wheel and dist-info names (PEP 427: '-' -> '_')."""
    return re.sub(r"[^\w\d.+]+", "_", version)


@dataclass
class _Entry:
    name: str
    source: zipfile.ZipInfo | None  # raw copy from the base when set
    data: bytes | None  # uncompressed bytes to write when set
    external_attr: int


def _dos_time(info: zipfile.ZipInfo) -> tuple[int, int]:
    y, mo, d, h, mi, s = info.date_time
    return (h << 11) | (mi << 5) | (s // 2), ((y - 1980) << 9) | (mo << 5) | d


class _Writer:
    """A minimal zip writer that can append raw compressed members of another archive."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.offset = 0
        self.central: list[bytes] = []

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.offset += len(data)

    def _header(self, name: str, method: int, dostime: int, dosdate: int, crc: int,
                csize: int, usize: int, external_attr: int) -> None:
        raw_name = name.encode("utf-8")
        flags = 0 if name.isascii() else _UTF8_FLAG
        self._check_size(name, csize, usize)
        header_offset = self.offset
        self._write(_LOCAL.pack(0x04034B50, 20, flags, method, dostime, dosdate, crc, csize,
                                usize, len(raw_name), 0) + raw_name)
        self._central_entry(raw_name, flags, method, dostime, dosdate, crc, csize, usize, external_attr,
                            header_offset)

    def _central_entry(self, raw_name: bytes, flags: int, method: int, dostime: int, dosdate: int, crc: int,
                       csize: int, usize: int, external_attr: int, header_offset: int) -> None:
        self.central.append(
            _CENTRAL.pack(0x02014B50, 0x031E, 20, flags, method, dostime, dosdate, crc, csize,
                          usize, len(raw_name), 0, 0, 0, 0, external_attr, header_offset)
            + raw_name
        )

    def add_bytes(self, name: str, data: bytes, external_attr: int) -> None:
        comp = zlib.compressobj(6, zlib.DEFLATED, -15)
        payload = comp.compress(data) + comp.flush()
        self._header(name, zipfile.ZIP_DEFLATED, _FIXED_DOS_TIME, _FIXED_DOS_DATE,
                     zlib.crc32(data), len(payload), len(data), external_attr)
        self._write(payload)

    def add_raw(self, name: str, src_fd: int, info: zipfile.ZipInfo) -> None:
        """Copy one member's compressed bytes under a (possibly new) name."""
        start = _data_start(src_fd, info)
        dostime, dosdate = _dos_time(info)
        self._header(name, info.compress_type, dostime, dosdate, info.CRC, info.compress_size,
                     info.file_size, info.external_attr)
        self._copy(src_fd, start, info.compress_size)

    def add_verbatim(self, src_fd: int, run: list[zipfile.ZipInfo]) -> None:
        """Copy members that keep their names as one byte range: local headers and data alike.

        ``run`` must be contiguous in the source (each member starts where the last ended);
        only their central-directory entries are written anew, with shifted offsets.
        """
        first = run[0].header_offset
        end = _data_start(src_fd, run[-1]) + run[-1].compress_size
        shift = self.offset - first
        for info in run:
            dostime, dosdate = _dos_time(info)
            self._check_size(info.filename, info.compress_size, info.file_size)
            self._central_entry(info.filename.encode("utf-8"), 0 if info.filename.isascii() else _UTF8_FLAG,
                                info.compress_type, dostime, dosdate, info.CRC, info.compress_size,
                                info.file_size, info.external_attr, info.header_offset + shift)
        self._copy(src_fd, first, end - first)

    def _check_size(self, name: str, csize: int, usize: int) -> None:
        if self.offset > _ZIP64_LIMIT or csize > _ZIP64_LIMIT or usize > _ZIP64_LIMIT:
            raise WheelError(f"{name!r}: member or archive needs zip64, which is not supported")

    def _copy(self, src_fd: int, pos: int, length: int) -> None:
        remaining = length
        while remaining:
            try:
                n = os.copy_file_range(src_fd, self.fd, remaining, pos)
            except OSError:
                n = 0
            if n <= 0:  # not supported here (or EOF): plain read/write
                chunk = os.pread(src_fd, min(remaining, 1 << 20), pos)
                if not chunk:
                    raise WheelError(f"base wheel truncated at byte {pos}")
                self._write(chunk)
                n = len(chunk)
            else:
                self.offset += n
            remaining -= n
            pos += n

    def finish(self) -> None:
        cd_offset = self.offset
        blob = b"".join(self.central)
        self._write(blob)
        count = len(self.central)
        if count > 0xFFFF or cd_offset > _ZIP64_LIMIT:
            raise WheelError("archive needs zip64, which is not supported")
        self._write(_EOCD.pack(0x06054B50, 0, 0, count, count, len(blob), cd_offset, 0))


def _data_start(src_fd: int, info: zipfile.ZipInfo) -> int:
    """Offset of a member's compressed bytes (after its local header, whose extra may differ)."""
    fields = _LOCAL.unpack(os.pread(src_fd, _LOCAL.size, info.header_offset))
    if fields[0] != 0x04034B50:
        raise WheelError(f"{info.filename!r}: bad local header in the base wheel")
    if fields[2] & 0x8:
        raise WheelError(f"{info.filename!r}: uses a data descriptor, which the raw copy does not support")
    return info.header_offset + _LOCAL.size + fields[9] + fields[10]


def dist_info_name(infos: list[zipfile.ZipInfo], wheel: Path) -> str:
    """The single top-level ``*.dist-info`` folder of a wheel."""
    names = {i.filename.split("/", 1)[0] for i in infos if "/" in i.filename}
    found = sorted(n for n in names if n.endswith(".dist-info"))
    if len(found) != 1:
        raise WheelError(f"{wheel.name}: expected one .dist-info folder, found {found or 'none'}")
    return found[0]


def read_record(zf: zipfile.ZipFile, dist_info: str, wheel: Path) -> dict[str, tuple[str, int]]:
    """Parse RECORD into ``path -> (hash, size)`` and cross-check it with the archive."""
    try:
        text = zf.read(f"{dist_info}/RECORD").decode()
    except KeyError:
        raise WheelError(f"{wheel.name}: no {dist_info}/RECORD") from None
    record: dict[str, tuple[str, int]] = {}
    for lineno, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not row:
            continue
        if len(row) != 3:
            raise WheelError(f"{wheel.name}: {dist_info}/RECORD:{lineno}: expected 3 fields, got {row!r}")
        path, digest, size = row
        if path == f"{dist_info}/RECORD":
            continue
        if not digest.startswith("sha256=") or not size.isdigit():
            raise WheelError(f"{wheel.name}: {dist_info}/RECORD:{lineno}: bad entry for {path!r}")
        record[path] = (digest, int(size))
    for info in zf.infolist():
        if info.filename.endswith("/") or info.filename == f"{dist_info}/RECORD":
            continue
        entry = record.get(info.filename)
        if entry is None:
            raise WheelError(f"{wheel.name}: member {info.filename!r} is missing from RECORD")
        if entry[1] != info.file_size:
            raise WheelError(
                f"{wheel.name}: member {info.filename!r} is {info.file_size} bytes, RECORD says {entry[1]}"
            )
    return record


def set_metadata_version(metadata: bytes, version: str) -> bytes:
    """Replace the ``Version:`` header of METADATA (headers only, not the description)."""
    text = metadata.decode("utf-8")
    head, sep, body = text.partition("\n\n")
    new_head, n = re.subn(r"^Version: .*$", f"Version: {version}", head, count=1, flags=re.M)
    if n != 1:
        raise WheelError("METADATA has no 'Version:' header")
    return (new_head + sep + body).encode("utf-8")


def rewrite_wheel(
    base: Path,
    out: Path,
    *,
    package: str,
    version: str,
    changed: dict[str, bytes],
    deleted: frozenset[str] = frozenset(),
    source: zipfile.ZipFile | None = None,
) -> None:
    """Write ``out`` = ``base`` with ``changed`` files, a new version and a fresh RECORD.

    ``changed`` maps archive paths to new bytes (created or replaced members); ``deleted``
    lists members to drop. The dist-info folder is renamed for ``version`` and its
    METADATA updated. ``out`` is written directly: callers write to a temporary name and
    rename it into place. ``source`` is ``base`` already open (its central directory is read
    once per build, not twice).
    """
    with contextlib.ExitStack() as stack:
        zf = source if source is not None else stack.enter_context(zipfile.ZipFile(base))
        infos = zf.infolist()
        dist_info = dist_info_name(infos, base)
        base_record = read_record(zf, dist_info, base)
        _check_changes(base, infos, dist_info, changed, deleted)
        metadata = {f"{dist_info}/METADATA": set_metadata_version(zf.read(f"{dist_info}/METADATA"), version)}
        new_dist_info = f"{package}-{escape_version(version)}.dist-info"
        entries = _entries(infos, dist_info, new_dist_info, {**metadata, **changed}, deleted)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        src_fd = os.open(base, os.O_RDONLY)
        try:
            writer = _Writer(fd)
            record_rows = _write_entries(writer, src_fd, entries, base_record)
            record_name = f"{new_dist_info}/RECORD"
            record_rows.append(_csv_row(record_name, "", ""))
            writer.add_bytes(record_name, "".join(record_rows).encode(), 0o100644 << 16)
            writer.finish()
            os.fsync(fd)
        finally:
            os.close(src_fd)
            os.close(fd)


def _check_changes(base: Path, infos: list[zipfile.ZipInfo], dist_info: str, changed: dict[str, bytes],
                   deleted: frozenset[str]) -> None:
    """Refuse to delete what the wheel lacks, or to patch its dist-info (the overlay writes that)."""
    base_names = {i.filename for i in infos}
    for path in deleted:
        if path not in base_names:
            raise WheelError(f"{base.name}: cannot delete {path!r}: not in the wheel")
    for path in changed:
        if path.startswith(f"{dist_info}/"):
            raise WheelError(f"{path!r}: the overlay cannot patch dist-info files")


def _entries(infos: list[zipfile.ZipInfo], dist_info: str, new_dist_info: str, new_data: dict[str, bytes],
             deleted: frozenset[str]) -> list[_Entry]:
    """The members of the new wheel in order: the base's (less ``deleted``), the new files, then the
    renamed dist-info; each with its base member (``source``) where its bytes stay the base's, else
    its new bytes (``new_data``: changed files and the new METADATA). RECORD is written apart."""
    base_names = {i.filename for i in infos}
    entries: list[_Entry] = []
    meta: list[_Entry] = []
    for info in infos:
        name = info.filename
        if name in deleted or name == f"{dist_info}/RECORD" or name.endswith("/"):
            continue
        data = new_data.get(name)
        source = None if data is not None else info
        if name.startswith(f"{dist_info}/"):
            meta.append(_Entry(new_dist_info + name[len(dist_info):], source, data, info.external_attr))
        else:
            entries.append(_Entry(name, source, data, info.external_attr))
    for name in sorted(set(new_data) - base_names):
        entries.append(_Entry(name, None, new_data[name], 0o100644 << 16))
    return entries + meta


def _write_entries(writer: _Writer, src_fd: int, entries: list[_Entry],
                   base_record: dict[str, tuple[str, int]]) -> list[str]:
    """Write every entry by one of three copy modes; return their RECORD rows.

    - verbatim: a base member under its own name: header and data copied as they are, contiguous
      members batched into one copy (:meth:`_Writer.add_verbatim`);
    - raw: a base member under a new name (the renamed dist-info): a new header, the compressed
      data copied (:meth:`_Writer.add_raw`);
    - bytes: new contents, compressed here (:meth:`_Writer.add_bytes`).
    """
    rows: list[str] = []
    run: list[zipfile.ZipInfo] = []  # verbatim members not written yet, contiguous in the base

    def flush() -> None:
        if run:
            writer.add_verbatim(src_fd, run)
            run.clear()

    for e in entries:
        src = e.source
        if src is not None and src.filename == e.name:  # verbatim
            if run and run[-1].header_offset + _entry_span(src_fd, run[-1]) != src.header_offset:
                flush()
            run.append(src)
            digest, size = base_record[src.filename]
        elif src is not None:  # raw
            flush()
            digest, size = base_record[src.filename]
            writer.add_raw(e.name, src_fd, src)
        else:  # bytes
            flush()
            assert e.data is not None
            digest, size = record_hash(e.data), len(e.data)
            writer.add_bytes(e.name, e.data, e.external_attr)
        rows.append(_csv_row(e.name, digest, str(size)))
    flush()
    return rows


def _entry_span(src_fd: int, info: zipfile.ZipInfo) -> int:
    """Bytes a member takes in its archive: local header, name, extra and data."""
    return _data_start(src_fd, info) - info.header_offset + info.compress_size


def _csv_row(*fields: str) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(fields)
    return buf.getvalue()


def verify_record(wheel: Path) -> int:
    """Decompress every member and check it against RECORD; return the member count."""
    with zipfile.ZipFile(wheel) as zf:
        infos = zf.infolist()
        dist_info = dist_info_name(infos, wheel)
        record = read_record(zf, dist_info, wheel)
        listed = {i.filename for i in infos}
        for path in record:
            if path not in listed:
                raise WheelError(f"{wheel.name}: RECORD lists {path!r}, which is not in the wheel")
        count = 0
        for info in infos:
            if info.filename == f"{dist_info}/RECORD" or info.filename.endswith("/"):
                continue
            with zf.open(info) as fh:  # zipfile checks each member's CRC as it reads
                digest = _record_digest(hashlib.file_digest(fh, "sha256"))
            if digest != record[info.filename][0]:
                raise WheelError(f"{wheel.name}: {info.filename!r} does not match its RECORD hash")
            count += 1
    return count
