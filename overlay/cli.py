"""The command line's front door: build the parser from ``overlay.commands``, dispatch, map errors.

Each verb's options and handler live in its module under ``overlay/commands/``; this module only
puts them together. Library code raises :class:`overlay.errors.OverlayError`; only this module
prints it (one line, ``error: ...``) and picks the exit code from it. An ``OSError`` that names a path
(a cache that is a file, a read-only ``.venv`` or ``dist/``) is one line too, naming the path and what
the OS said (exit 1). Other unexpected exceptions keep their traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from overlay.commands import MODULES
from overlay.commands.common import refuse_empty_values
from overlay.errors import OverlayError, os_error_line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="overlay", description="patched vLLM overlay builds")
    p.add_argument("--patches", default="patches", help="folder holding patches/<version>/")
    sub = p.add_subparsers(dest="command", required=True, metavar="VERB")
    for name in MODULES:
        importlib.import_module(f"overlay.commands.{name}").configure_parser(sub)
    refuse_empty_values(p)  # --dist '' is the current folder: no option takes an empty value
    return p


def verbs() -> dict[str, str]:
    """Every verb and its one-line help, in ``overlay --help`` order."""
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {c.dest: c.help or "" for c in sub._choices_actions}


def _path_hints(ns: argparse.Namespace) -> dict[str, str]:
    """The folders an OS error's path may lie in, and what to call them in its line."""
    import os

    from overlay.build.fetch import cache_dir

    hints = {}
    if getattr(ns, "install", None):
        hints[str(Path(ns.install))] = f"in the environment {ns.install} (--install; make: VENV)"
    where = "VLLM_OVERLAY_CACHE" if os.environ.get("VLLM_OVERLAY_CACHE") else "the default; VLLM_OVERLAY_CACHE moves it"
    try:
        cache = cache_dir()
    except OverlayError:  # a cache the tool refuses holds nothing the run wrote
        return hints
    hints[str(cache)] = f"under the tool's cache {cache} ({where})"
    return hints


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    try:
        if getattr(ns, "vllm", "") is None:
            from overlay.build.pins import default_version

            ns.vllm = default_version(Path(ns.patches))
        return ns.handler(ns)
    except OverlayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        if exc.filename is None:  # no path to name: an unexpected error, with its traceback
            raise
        print(f"error: {os_error_line(exc, _path_hints(ns))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
