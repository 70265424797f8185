"""The real engine on GPUs: ``engine-check`` (every DCP case against DCP 1), ``engine-variants`` (the
seed-bug trees it must catch), ``engine-checkpoint`` (the tiny GLM-5 it serves), ``engine-plot``, and
``liveness-lines`` (the lines each patch adds, which ``engine-check --coverage`` counts).

Those of them in :data:`overlay.commands.DEVICE_VERBS` run on the GPU device machine with its system
Python (``python3 -m overlay engine-check``), the others in the venv: nothing here imports more than
the standard library until a handler runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from overlay.commands.common import add_vllm, at_least, non_negative, positive, root


def configure_parser(sub: argparse._SubParsersAction) -> None:
    text = ("GPUs: real vLLM engine, tiny GLM-5 checkpoint, every DCP case against DCP 1; "
            "exit 0 pass, 1 a case failed, 2 the reference failed")
    ap = sub.add_parser("engine-check", help=text, description=text)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, help="checkpoint folder (generated there when missing)")
    ap.add_argument("--tp", type=at_least(1), default=2)
    ap.add_argument("--cases", help="comma-separated case names (default: all for --tp, in order)")
    ap.add_argument("--timeout", type=positive("seconds"), default=420, help="seconds per case")
    ap.add_argument("--budget", type=non_negative(), default=0,
                    help="stop starting cases after this many seconds (0: none)")
    ap.add_argument("--parallel", type=at_least(1), default=1, help="engines at once on the same GPUs (default 1)")
    ap.add_argument("--tree", type=Path, help="a vLLM tree to put first on the children's PYTHONPATH")
    ap.add_argument("--rejudge", action="store_true", help="judge the cases already in --out again (no runs)")
    ap.add_argument("--reuse", type=Path, help="take the reference and spread results of an earlier --out here")
    ap.add_argument("--variant", type=Path, help="a variant tarball (engine-variants): lay it over vllm, use as --tree")
    ap.add_argument("--variants", type=Path, help="engine-variants' folder: add one job per seed-bug variant")
    ap.add_argument("--expect", help="crash:REGEX, mismatch or pass: what the checked cases must show (seed-bug "
                                     "variants)")
    ap.add_argument("--vllm", dest="release", metavar="RELEASE",
                    help="the release whose build the engines must import (e.g. 0.33.0): refused in one line when "
                         "the installed vllm (or --tree's) is another (default: whichever is installed)")
    ap.add_argument("--coverage", action="store_true",
                    help="run every engine under coverage.py: per case and patch, how many of its added statements "
                         "ran; a patch the case declares (Case.acts) that ran none fails it")
    ap.add_argument("--liveness", type=Path, metavar="FILE",
                    help="with --coverage: the lines each patch added (overlay liveness-lines; default "
                         "$OVERLAY_LIVENESS, which scripts/device-run.sh sets to the staged one)")
    ap.set_defaults(handler=cmd_engine_check)

    text = "the seed-bug variant trees (the series minus each fix, stock) that engine-check must catch"
    sp = sub.add_parser("engine-variants", help=text, description=text)
    add_vllm(sp)
    sp.add_argument("--out", type=Path, required=True)
    sp.set_defaults(handler=cmd_engine_variants)

    text = ("the tiny GLM-5-architecture checkpoint engine-check and bench-engine serve (deterministic; "
            "--glm5-per-rank: production's per-rank shape, config only)")
    sp = sub.add_parser("engine-checkpoint", help=text, description=text)
    sp.add_argument("--out", type=Path, help="folder to write (default: the cache, named by spec and seed)")
    sp.add_argument("--seed", type=at_least(0), default=0)
    sp.add_argument("--tp", type=at_least(1), help="TP size the heads are sized for (default: the spec's, 2)")
    sp.add_argument("--layers", type=at_least(1), help="decoder layers (default: the spec's, 3)")
    sp.add_argument("--force", action="store_true", help="overwrite an existing folder")
    sp.add_argument("--verify", action="store_true",
                    help="before reusing an existing checkpoint, check every file's sha256 too (not only its size)")
    sp.add_argument("--glm5-per-rank", action="store_true",
                    help="GLM-5's depth and attention at production's per-rank shape (glm5_per_rank), config and "
                         "tokenizer only: serve it with --load-format dummy (timing, not numbers)")
    sp.add_argument("--production-tp", type=at_least(1), default=8,
                    help="with --glm5-per-rank: production's TP (8)")
    sp.add_argument("--weight-bytes", type=positive("bytes"), default=None, metavar="BYTES",
                    help="with --glm5-per-rank: production's bytes per FFN weight (default NVFP4 0.5625; FP8 1)")
    sp.set_defaults(handler=cmd_engine_checkpoint)

    text = "draw engine-check results (results.json, several side by side) as one PNG"
    sp = sub.add_parser("engine-plot", help=text, description=text)
    sp.add_argument("results", type=Path, nargs="+")
    sp.add_argument("--out", type=Path, required=True)
    sp.set_defaults(handler=cmd_engine_plot)

    text = ("the lines each patch of a release's series adds (git blame of the series replayed), as JSON: what "
            "engine-check --coverage counts (--liveness)")
    sp = sub.add_parser("liveness-lines", help=text, description=text)
    add_vllm(sp)
    sp.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    sp.set_defaults(handler=cmd_liveness_lines)


def cmd_engine_check(ns: argparse.Namespace) -> int:
    from dataclasses import fields

    from overlay.engine.check import CheckOptions, run_check

    return run_check(CheckOptions(**{f.name: getattr(ns, f.name) for f in fields(CheckOptions)}))


def cmd_engine_variants(ns: argparse.Namespace) -> int:
    from overlay.engine.variants import build_variants

    m = build_variants(root(ns), ns.vllm, ns.out)
    for name, v in m["variants"].items():
        shows = "; ".join(f"expect {j['expect']} on {j['case'] or '(not on this machine)'}"
                          for j in v.get("jobs") or [v])
        print(f"{name}: {v['what']}; {shows}")
    return 0


def cmd_engine_checkpoint(ns: argparse.Namespace) -> int:
    from overlay.engine.checkpoint import (
        NVFP4_BYTES,
        TinyGlm5Spec,
        checkpoint_id,
        default_cache,
        generate,
        glm5_per_rank,
        write_config_only,
    )
    from overlay.errors import UsageError

    tp = ns.tp or TinyGlm5Spec.tp
    if ns.glm5_per_rank:
        if ns.out is None:
            raise UsageError("engine-checkpoint: --glm5-per-rank needs --out")
        weight_bytes = NVFP4_BYTES if ns.weight_bytes is None else ns.weight_bytes
        write_config_only(ns.out, glm5_per_rank(tp, ns.production_tp, weight_bytes), force=ns.force)
        print(ns.out)
        return 0
    spec = TinyGlm5Spec(tp=tp, num_hidden_layers=ns.layers or TinyGlm5Spec.num_hidden_layers)
    out = ns.out or default_cache() / checkpoint_id(spec, ns.seed)
    generate(out, spec, ns.seed, force=ns.force, verify=ns.verify)
    print(out)
    return 0


def cmd_engine_plot(ns: argparse.Namespace) -> int:
    from overlay.engine.plot import draw
    from overlay.engine.verdict import read_results
    from overlay.errors import OverlayError

    docs = [(path.stem, read_results(path, OverlayError)) for path in ns.results]
    print(draw(docs, ns.out), file=sys.stdout)
    return 0


def cmd_liveness_lines(ns: argparse.Namespace) -> int:
    from overlay.atomic import write_file
    from overlay.build.pipeline import series_wheel
    from overlay.engine.liveness_lines import dump, lines_doc, summary
    from overlay.outpaths import check_file

    check_file(ns.out, "--out").parent.mkdir(parents=True, exist_ok=True)
    doc = lines_doc(series_wheel(root(ns), ns.vllm))
    write_file(ns.out, dump(doc))
    print(f"{summary(doc)} -> {ns.out}")
    return 0
