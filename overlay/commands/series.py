"""The series itself: ``status`` (each patch, does it apply; per release and patch, what is proven; the upstream
reports judged on GLM-5's path), ``workspace``
and ``export`` (patches as commits)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from overlay.commands.common import add_vllm, root


def configure_parser(sub: argparse._SubParsersAction) -> None:
    text = ("each patch: subject, origin, kind, files, applies to the pinned base; then per release and patch: "
            "rebased, on GLM-5's path, proven in an engine (where, DCP size, when); then per release the "
            "upstream reports judged on GLM-5's path (verdict, evidence)")
    sp = sub.add_parser("status", help=text, description=text)
    add_vllm(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(handler=cmd_status)

    text = "git tree of the base with the series as commits, for editing patches"
    sp = sub.add_parser("workspace", help=text, description=text)
    add_vllm(sp)
    sp.add_argument("--dest")
    sp.set_defaults(handler=cmd_workspace)

    text = "write the workspace's commits back as the series (deterministic)"
    sp = sub.add_parser("export", help=text, description=text)
    add_vllm(sp)
    sp.add_argument("--src")
    sp.add_argument("--allow-dirty", action="store_true",
                    help="export the commits although the workspace has uncommitted changes (they stay out)")
    sp.set_defaults(handler=cmd_export)


def cmd_status(ns: argparse.Namespace) -> int:
    from overlay.build.pins import default_version
    from overlay.maintain.engine_records import engine_runs, records_root, unreadable
    from overlay.maintain.proven import format_proven, proven, retired
    from overlay.maintain.status import format_table, series_status
    from overlay.maintain.upstream_reports import format_reports, load

    rows = series_status(root(ns), ns.vllm)
    records = records_root(root(ns))
    runs = engine_runs(records)
    releases, unnamed = proven(root(ns), records, runs)
    unread = unreadable(records)
    gone = retired(root(ns), runs)
    default = default_version(root(ns))
    reports = {rel.release: load(root(ns), rel.release) for rel in releases}
    if ns.json:
        print(json.dumps({"release": ns.vllm, "patches": [r.to_dict() for r in rows],
                          "proven": [r.to_dict() for r in releases], "records_naming_no_build": unnamed,
                          "records_not_read": unread, "default": default, "retired_records": gone,
                          "upstream_reports": {rel: [r.to_dict() for r in found] for rel, found in reports.items()}},
                         indent=2))
    else:
        judged = [line for rel, found in reports.items() for line in format_reports(rel, found)]
        sys.stdout.write(format_table(rows, ns.vllm)
                         + format_proven(releases, unnamed, records, unread, default=default, gone=gone)
                         + "".join(f"{line}\n" for line in judged))
    return 0 if all(r.applies for r in rows) else 1


def cmd_workspace(ns: argparse.Namespace) -> int:
    from overlay.maintain.workspace import create

    dest = Path(ns.dest or f".work/{ns.vllm}")
    create(root(ns), ns.vllm, dest)
    print(dest)
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from overlay.maintain.workspace import export

    src = Path(ns.src or f".work/{ns.vllm}")
    names = export(src, root(ns), ns.vllm, allow_dirty=ns.allow_dirty)
    print(f"exported {len(names)} patch(es) to {root(ns) / ns.vllm}", file=sys.stderr)
    return 0
