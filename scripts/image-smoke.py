"""Smoke check run inside the image: the installed vLLM is our patched build.

    python3 scripts/image-smoke.py --version 0.28.0+ovl1a2b3c4d5e --base 0.28.0 --tag ovl1a2b3c4d5e
    ... --expect - --cli < expect.json          # what `make image-smoke` adds

Imports ``vllm``, compares ``vllm.__version__`` with ``--version``, reads ``vllm/_overlay.json``
(written by the overlay build) to check its version, base release and series tag, and counts the
installed vLLM distributions (exactly one: pip replaced the base's). ``--expect FILE`` (``-``:
stdin) names, per patch, the lines it adds to files of the package (``overlay.image.smoke`` derives
them from the series); each must be a line of the installed file. ``--cli`` runs ``vllm --help``
on the CPU platform. Standard library only: the runtime image does not carry the overlay tool.
Exit 0 and one ``smoke: ok ...`` line, or exit 1 and one ``smoke: ...`` line naming every fault.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import subprocess
import sys
from pathlib import Path


def _manifest(version: str, base: str, tag: str) -> tuple[list[str], list[dict]]:
    """Problems with ``vllm/_overlay.json``, and its patch list."""
    res = importlib.resources.files("vllm") / "_overlay.json"
    try:
        doc = json.loads(res.read_text())
    except FileNotFoundError:
        return [f"{res}: missing (not an overlay build)"], []
    except json.JSONDecodeError as exc:
        return [f"{res}: not JSON: {exc}"], []
    problems = []
    if doc.get("version") != version:
        problems.append(f"'version' is {doc.get('version')!r}, expected {version!r}")
    got_base = (doc.get("base") or {}).get("version")
    if got_base != base:
        problems.append(f"'base.version' is {got_base!r}, expected {base!r}")
    if tag and not str(doc.get("version", "")).endswith("+" + tag):
        problems.append(f"'version' {doc.get('version')!r} does not carry series tag {tag!r}")
    return [f"{res}: {p}" for p in problems], doc.get("patches") or []


def _dist_infos() -> list[str]:
    """Every installed ``vllm`` distribution on ``sys.path`` (a leftover one would shadow or confuse pip)."""
    return sorted({str(found.resolve()) for entry in sys.path if entry and Path(entry).is_dir()
                   for found in Path(entry).glob("vllm-*.dist-info")})


def _missing_lines(expect: dict[str, dict[str, list[str]]], root: Path) -> list[str]:
    """Per patch: the expected added lines that are not lines of the installed file."""
    problems = []
    for patch, files in expect.items():
        gone = []
        total = 0
        for path, lines in files.items():
            total += len(lines)
            try:
                have = {ln.strip() for ln in (root / path).read_text().splitlines()}
            except FileNotFoundError:
                gone += [f"{path} (no such file)"] * len(lines)
                continue
            gone += [f"{path}: {ln.strip()!r}" for ln in lines if ln.strip() not in have]
        if gone:
            problems.append(f"{patch}: {len(gone)} of {total} added line(s) missing, first {gone[0]}")
    return problems


def _cli() -> list[str]:
    """``vllm --help`` (the CPU platform: the stand-in has no GPU) exits 0 with vLLM's usage."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    try:
        proc = subprocess.run(["vllm", "--help"], capture_output=True, text=True, env=env, timeout=600, check=False)
    except FileNotFoundError:
        return ["`vllm` is not on PATH"]
    except subprocess.TimeoutExpired:
        return ["`vllm --help` did not finish in 600 s"]
    if proc.returncode != 0 or "usage: vllm" not in proc.stdout:
        tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-1:]
        return [f"`vllm --help` exit {proc.returncode}: {tail[0] if tail else 'no usage printed'}"]
    return []


def check(version: str, base: str, tag: str, expect: dict[str, dict[str, list[str]]] | None = None,
          cli: bool = False) -> str:
    """Return the success line; raise ``SystemExit`` with one line naming every fault."""
    try:
        import vllm
    except Exception as exc:  # the message is the report; the image build stops on it
        raise SystemExit(f"smoke: import vllm failed: {type(exc).__name__}: {exc}") from None
    got = getattr(vllm, "__version__", None)
    problems = [] if got == version else [f"vllm.__version__ is {got!r}, expected {version!r}"]
    found, patches = _manifest(version, base, tag)
    problems += found
    dists = _dist_infos()
    if len(dists) != 1:
        problems.append(f"{len(dists)} vllm distributions installed, expected 1: {', '.join(dists) or 'none'}")
    if expect is not None:
        problems += _missing_lines(expect, Path(vllm.__file__).resolve().parent.parent)
    if cli:
        problems += _cli()
    if problems:
        raise SystemExit("smoke: " + "; ".join(problems))
    kinds = sorted({p.get("kind", "?") for p in patches})
    extra = "".join([f", added lines of {len(expect)} patch(es) present" if expect is not None else "",
                     ", `vllm --help` ok" if cli else ""])
    return f"smoke: ok vllm {got}, {len(patches)} patch(es) ({', '.join(kinds) or 'none'}), 1 dist-info{extra}"


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run :func:`check`, print its line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", required=True, help="expected vllm.__version__")
    p.add_argument("--base", required=True, help="expected base release (vLLM version)")
    p.add_argument("--tag", default="", help="expected series tag (local version label)")
    p.add_argument("--expect", metavar="FILE", help="JSON {patch: {path: [added line, ...]}}; - reads stdin")
    p.add_argument("--cli", action="store_true", help="also run `vllm --help` (CPU platform)")
    ns = p.parse_args(argv)
    expect = None
    if ns.expect:
        try:
            expect = json.loads(sys.stdin.read() if ns.expect == "-" else Path(ns.expect).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"smoke: --expect {ns.expect}: {exc}") from None
    print(check(ns.version, ns.base, ns.tag, expect, ns.cli))
    return 0


if __name__ == "__main__":
    sys.exit(main())
