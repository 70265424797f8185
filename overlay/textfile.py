"""Text input files decoded one way: UTF-8, no byte-order mark, and what is wrong named.

Every file a person writes for the tool (a ``series``, a patch, ``pin.toml``, ``patches/DEFAULT``, a
regress profile, an ``upstream_expected`` table) is read through :func:`decode`. A file an editor saved
with a byte-order mark, as UTF-16, or with CRLF line endings gets one line that says so and names the
file, instead of what the parser after it makes of the stray bytes ("Invalid statement (at line 1,
column 1)", "no blank line after the mail headers"). Where a file must be the person's own (a ``series``,
a pin, a patch under ``patches/``), :func:`refuse_link_out` refuses one reached through a symbolic link out of
its folder before it is read, so no error line quotes a file the person did not write.
"""

from __future__ import annotations

import codecs
from pathlib import Path

from overlay.errors import OverlayError, one_line

# Longest first: UTF-32 LE's mark starts with UTF-16 LE's.
_BOMS: tuple[tuple[bytes, str], ...] = (
    (codecs.BOM_UTF32_LE, "a UTF-32 byte-order mark (FF FE 00 00): the file is UTF-32 text"),
    (codecs.BOM_UTF32_BE, "a UTF-32 byte-order mark (00 00 FE FF): the file is UTF-32 text"),
    (codecs.BOM_UTF8, "a UTF-8 byte-order mark (EF BB BF)"),
    (codecs.BOM_UTF16_LE, "a UTF-16 byte-order mark (FF FE): the file is UTF-16 text"),
    (codecs.BOM_UTF16_BE, "a UTF-16 byte-order mark (FE FF): the file is UTF-16 text"),
)
FIX_BOM = "save it as UTF-8 without a byte-order mark"


def decode(raw: bytes, source: str, error: type[OverlayError] = OverlayError, *, bom_ok: bool = False) -> str:
    """``raw`` as UTF-8 text; a byte-order mark (but a UTF-8 one where ``bom_ok``: YAML allows it) or bytes
    that are not UTF-8 raise ``error`` in one line naming ``source`` (and the line and byte of a bad one)."""
    for bom, what in _BOMS:
        if raw.startswith(bom):
            if bom_ok and bom == codecs.BOM_UTF8:
                raw = raw[len(bom):]
                break
            raise error(f"{source}: starts with {what}; {FIX_BOM}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise error(f"{source}:{line}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                    "save it as UTF-8") from None


def refuse_empty(text: str, source: str, error: type[OverlayError], what: str) -> None:
    """Raise ``error`` naming ``source`` when it holds nothing but whitespace: say it is empty, rather than
    what a parser makes of no text (no 'From ' line, missing fields, not a mapping)."""
    if not text.strip():
        raise error(f"{source}: is empty{'' if not text else ' (only whitespace)'}, not {what}")


def refuse_crlf(text: str, source: str, error: type[OverlayError], lines: tuple[str, ...] = ()) -> None:
    """Raise ``error`` naming ``source`` and the line when a line ends in CR LF; with ``lines`` only lines
    that start with one of them count (a patch's own lines: a hunk may carry a CRLF file's content)."""
    for number, line in enumerate(text.split("\n"), start=1):
        if line.endswith("\r") and (not lines or line.startswith(lines)):
            raise error(f"{source}:{number}: CRLF line endings (an editor or git's core.autocrlf converted "
                        "the file); save it with LF line endings")


def refuse_link_out(path: Path, folder: Path, error: type[OverlayError], rule: str) -> None:
    """Raise ``error`` naming ``path`` when, its links followed (its own or a folder's on the way), it lies outside
    ``folder``; ``rule`` ends the line. Nothing is read: a ``series`` linked to ``/tmp/secret`` or
    ``~/.ssh/id_rsa`` never reaches a parser whose error line would quote its first line."""
    try:
        real = path.resolve()
        inside = folder.resolve()
    except (OSError, RuntimeError):  # Python 3.11 and 3.12 raise RuntimeError for a loop, later ones OSError
        raise error(f"{path}: a symbolic link that leads back to itself (a loop): {rule}") from None
    if real != inside and inside not in real.parents:
        raise error(f"{path}: reached through a symbolic link out of {folder} (to {one_line(str(real))}): {rule}")
