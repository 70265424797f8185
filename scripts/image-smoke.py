"""Smoke check run inside the image: the installed vLLM is our patched build.

    python3 scripts/image-smoke.py --version 0.28.0+ovl1a2b3c4d5e --base 0.28.0 --tag ovl1a2b3c4d5e

Imports ``vllm``, compares ``vllm.__version__`` with ``--version``, and reads
``vllm/_overlay.json`` (written by the overlay build) to check its version, base release and
series tag. Standard library only: the runtime image does not carry the overlay tool.
Exit 0 and one ``smoke: ok ...`` line, or exit 1 and one ``smoke: ...`` line naming the fault.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import sys


def check(version: str, base: str, tag: str) -> str:
    """Return the success line; raise ``SystemExit`` with one line on the first mismatch."""
    try:
        import vllm
    except Exception as exc:  # the message is the report; the image build stops on it
        raise SystemExit(f"smoke: import vllm failed: {type(exc).__name__}: {exc}") from None
    got = getattr(vllm, "__version__", None)
    if got != version:
        raise SystemExit(f"smoke: vllm.__version__ is {got!r}, expected {version!r}")
    res = importlib.resources.files("vllm") / "_overlay.json"
    try:
        doc = json.loads(res.read_text())
    except FileNotFoundError:
        raise SystemExit(f"smoke: {res}: missing (not an overlay build)") from None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"smoke: {res}: not JSON: {exc}") from None
    problems = []
    if doc.get("version") != version:
        problems.append(f"'version' is {doc.get('version')!r}, expected {version!r}")
    got_base = (doc.get("base") or {}).get("version")
    if got_base != base:
        problems.append(f"'base.version' is {got_base!r}, expected {base!r}")
    if tag and not str(doc.get("version", "")).endswith("+" + tag):
        problems.append(f"'version' {doc.get('version')!r} does not carry series tag {tag!r}")
    if problems:
        raise SystemExit(f"smoke: {res}: " + "; ".join(problems))
    patches = doc.get("patches") or []
    kinds = sorted({p.get("kind", "?") for p in patches})
    return f"smoke: ok vllm {got}, {len(patches)} patch(es) ({', '.join(kinds) or 'none'})"


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run :func:`check`, print its line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", required=True, help="expected vllm.__version__")
    p.add_argument("--base", required=True, help="expected base release (vLLM version)")
    p.add_argument("--tag", default="", help="expected series tag (local version label)")
    ns = p.parse_args(argv)
    print(check(ns.version, ns.base, ns.tag))
    return 0


if __name__ == "__main__":
    sys.exit(main())
