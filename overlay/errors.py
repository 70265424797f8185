"""The tool's exception root and its few subclasses.

Library code raises these; only ``overlay.cli`` turns them into one line on stderr and an
exit code. Messages name the file, patch, hunk or field at fault.
"""

from __future__ import annotations

SHOWN_MAX = 80  # the longest piece of a file an error line quotes


def shown(text: str, limit: int = SHOWN_MAX) -> str:
    """A piece of a file (a series line, a pin field, a hunk header) for an error line.

    Quoted when it is short and printable (a typo in a series line is worth seeing); else only
    its length: an error line never carries a file's content beyond that, whatever the file is
    (a ``series`` or ``pin.toml`` that is a link to ``/proc/self/environ`` holds NUL-separated
    secrets on one line).
    """
    if len(text) <= limit and all(ch.isprintable() or ch == "\t" for ch in text):
        return repr(text)
    what = "characters" if len(text) > limit else "characters with control characters"
    return f"<{len(text)} {what}, not shown>"


def shown_value(value: object) -> str:
    """A value loaded from a file (YAML, TOML) for an error line: its ``repr`` cut by :mod:`reprlib` (a few
    items of each list and mapping, two levels deep, long strings cut with ``...``), so the cost and the
    length of the line are bounded whatever the value is (a nested list of a billion items included)."""
    import reprlib

    cut = reprlib.Repr()
    cut.maxlevel = 2
    cut.maxlist = cut.maxtuple = cut.maxdict = cut.maxset = cut.maxfrozenset = 4
    cut.maxstring = cut.maxother = SHOWN_MAX // 2
    text = cut.repr(value)
    return text if text.isprintable() else repr(text)


def one_line(name: str) -> str:
    """A file name for an error line: as it is when printable, else its ``repr`` (a newline or escape
    in a quoted git path cannot break the one line or write to the terminal)."""
    return name if name.isprintable() else repr(name)


class OverlayError(Exception):
    """Root of every error the tool reports to a user as one line."""

    exit_code = 1


class UsageError(OverlayError):
    """Options that cannot make a run, found after parsing (argparse's own refusals exit 2 too)."""

    exit_code = 2


class PinError(OverlayError):
    """A ``pin.toml`` is missing, malformed or names an unknown release."""


class FetchError(OverlayError):
    """A release file could not be fetched, or its digest does not match the pin."""


class SeriesError(OverlayError):
    """A ``series`` file or a patch file in it is malformed or missing."""


class ApplyError(OverlayError):
    """A patch does not apply to the base it is meant for."""


class KernelPatchError(OverlayError):
    """A patch touches compiled sources and cannot be overlaid on prebuilt binaries."""


class WheelError(OverlayError):
    """A wheel is malformed or cannot be rewritten."""


class GitError(OverlayError):
    """A git command failed."""

    def __init__(self, cmd: list[str], returncode: int, stderr: str) -> None:
        self.cmd = cmd
        self.returncode = returncode
        self.stderr = stderr
        detail = stderr.strip().splitlines()
        tail = detail[-1] if detail else "no output"
        super().__init__(f"git {' '.join(cmd)!s} failed ({returncode}): {tail}")


class LockError(OverlayError):
    """A lock file that cannot be one: a symbolic link, a folder, not openable."""


class DistError(OverlayError):
    """The output folder (``dist/``) cannot take the built wheel: not a folder, not writable, disk full."""


def os_error_line(exc: OSError, hints: dict[str, str] | None = None) -> str:
    """An ``OSError`` that names a path as one line: the path, what the OS said and, for "not a
    directory", which part of the path is a file. ``hints`` maps folders to what they are (the
    cache, ``VLLM_OVERLAY_CACHE``): a path under one says which it is under."""
    import errno
    from pathlib import Path

    path = Path(str(exc.filename))
    what = exc.strerror or str(exc)
    line = f"{path}: {what}"
    if exc.filename2 is not None:
        line = f"{path} -> {exc.filename2}: {what}"
    if exc.errno == errno.ENOTDIR or (exc.errno == errno.EEXIST and not path.is_dir()):
        for part in [*reversed(path.parents), path]:
            if part.exists() and not part.is_dir():
                line += f" ({part} is a file, not a folder)" if part != path else " (it is a file, not a folder)"
                break
    for folder, name in (hints or {}).items():
        if path == Path(folder) or Path(folder) in path.parents:
            line += f"; it is {name}"
            break
    return line
