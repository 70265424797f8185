"""The seed-bug variants of the patched tree, for proving that the engine check catches each bug.

A variant is the series with one fix left out (the capability patch flashmla-sparse-dcp is
what every DCP run needs, so its variant is ``stock``) (or, when a later patch builds on that fix's
lines, the series *up to* that fix: the tree as it was before the fix), plus ``stock``, the
unpatched base. For each, this writes ``<variant>.tar.gz`` holding every file the whole series
touches, with that variant's contents (the base's where the variant leaves a file alone), and
``variants.json`` naming what each variant is and what the check must see (the bug report's
symptom; for a release whose code makes a variant show something else, the ``[[expect]]`` of its own
``patches/<release>/engine.toml``: one or more cases each, ``pass`` where the fix does nothing there).
On the device, ``overlay engine-check --variants`` lays each variant over the installed tree as a symlink
farm (:func:`overlay.engine.inputs.lay_variant`) and runs it (``overlay engine-variants`` writes them).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from overlay.build.apply import apply_series, wheel_reader
from overlay.build.archive import tar_bytes
from overlay.build.fetch import fetch_wheel
from overlay.build.pins import load_pin, pin_dir
from overlay.build.series import Patch, Series
from overlay.errors import ApplyError
from overlay.releases import engine_cases

# The fix patches: what the engine check must see without each (the seed's bug reports), and
# the case that shows it (None: cannot be shown on a machine without NVLink multicast). Every patch
# of the default series is here or in NO_VARIANT (tests/test_one_source.py): a fix in neither
# would get no seed-bug variant.
EXPECT: dict[str, tuple[str, str, str | None]] = {
    "stock": ("crash:requires attention implementations to return the softmax LSE",
              "the engine refuses to start: FlashMLA-sparse returns no decode LSE",
              "dcp-a2a-direct-proj1-graph-mtp"),
    # With interleave 1 MTP steps are decodes and FULL graphs capture them; with interleave > 1
    # they are built as prefills, whose paths cannot be captured.
    "flashmla-sparse-dcp-spec-cudagraphs.patch": (
        "crash:operation not permitted when stream is capturing|previous error during capture",
        "the engine dies capturing full CUDA graphs of MTP prefill paths under DCP with interleave > 1 "
        "(at interleave 1, two H200s, 2026-11-30, before MTP steps stayed decodes)",
        "dcp-a2a-direct-proj1-graph-mtp-il16"),
    "sparse-mla-decode-metadata-guard.patch": ("crash:has no attribute 'decode'",
                                               "AttributeError on attn_metadata.decode",
                                               "dcp-a2a-direct-proj1-graph-mtp"),
    "dcp-forced-mqa-prefill-rows.patch": ("mismatch", "wrong prefill (prompt) logprobs: prefill rows lose a rank",
                                          "dcp-agrs-proj1-graph"),
    # The direct q-gather needs NVLink multicast (off on the device): the NCCL gather runs instead.
    "dcp-direct-q-gather-fallback.patch": ("crash:out of bounds for storage|exceeds symmetric q-gather buffer",
                                           "a prefill-sized batch overflows the direct q-gather workspace", None),
    "dcp-direct-a2a-fallback.patch": ("crash:token count exceeds symmetric buffer capacity",
                                      "the long prompt kills the engine in the direct A2A lse_reduce",
                                      "dcp-a2a-direct-proj1-graph"),
    # DCP 1: shows on one GPU too (judged against ref-dcp1, the same engine without MTP)
    "spec-decode-prompt-logprobs-graph-pool.patch": (
        "mismatch", "MTP moves prompt logprobs: computed from drafter output in the CUDA-graph pool "
        "(the first request, 92 of 100 positions, up to 11.3 nats at DCP 1 on two H200s, 2026-11-30)",
        "ref-dcp1-mtp"),
}


def expectations(version: str, key: str) -> tuple[tuple[str, str, str | None], ...]:
    """What the variant of ``key`` (``stock`` or a patch file name) must show on ``version``'s build: the
    release's own ``[[expect]]`` jobs (``patches/<version>/engine.toml``, where its code makes a variant show
    something else than EXPECT says: ``pass`` where the fix does nothing there), else :data:`EXPECT`."""
    own = engine_cases.load(version).expect.get(key)
    return own if own is not None else (EXPECT[key],)


# The patches of the series without a variant of their own, and why.
NO_VARIANT: dict[str, str] = {
    "flashmla-sparse-dcp.patch": "the capability every DCP run needs: without it nothing runs, which is stock",
    "dcp-project-before-merge.patch": "the optimization: exact by construction, no bug to bring back",
    "dcp-project-before-merge-fused.patch": "the optimization's opt-in kernels, off by default: no bug to bring back",
    "dcp-sparse-mla-v-up-proj-combine.patch": "the optimization on GLM-5's sparse path (NCCL a2a): exact by "
                                              "construction, no bug to bring back (without it, memory unused)",
    "dcp-mla-combine-v-up-proj-helper.patch": "a refactor: one merge-and-project for both MLA paths, no bug to "
                                              "bring back",
    "dcp-v-up-proj-before-merge-config.patch": "the optimization's switch: exact either way, no bug to bring back",
    "dcp-v-up-proj-combine-ag-rs-direct.patch": "the optimization on ag_rs and the direct A2A, opt-in: exact by "
                                                "construction, no bug to bring back",
}


# Trees for bench-engine's A/B, not bugs: the series plus a patch of the release's own
# ``patches/<version>/bench-variants/<name>.patch`` that brings an earlier behaviour back. No case: nothing
# is expected of them.
BENCH_VARIANTS: dict[str, str] = {
    "mtp-as-prefills": "MTP steps built as prefills under DCP and spec decoding in PIECEWISE graphs "
                       "(the series before 2026-12-01): bench-engine's B for the MTP graph-mode A/B",
}
BENCH_VARIANTS_DIR = "bench-variants"


def build_variants(patches_root: Path, version: str, out: Path, *, base_wheel: Path | None = None) -> dict[str, Any]:
    """Write every variant's tarball and ``variants.json`` into ``out``; return the manifest."""
    series = Series.load(pin_dir(patches_root, version))
    wheel = base_wheel or fetch_wheel(load_pin(patches_root, version))
    names = [p.name for p in series.patches]
    touched = sorted({t for p in series.patches for t in p.touched})
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"version": version, "series": names, "files": touched, "variants": {}}
    with zipfile.ZipFile(wheel) as zf:
        read = wheel_reader(zf)
        base = {t: read(t) for t in touched}

        def tree(patches: tuple) -> dict[str, bytes]:
            applied = apply_series(patches, read)
            return {t: applied.changed.get(t, base[t]) for t in touched if t in applied.changed or base[t] is not None}

        plans: list[tuple[str, tuple, str]] = [("stock", (), "the unpatched base")]
        for i, p in enumerate(series.patches):
            if p.name not in EXPECT:
                continue  # NO_VARIANT: not a fix (the optimization) or the capability every variant lacks (stock)
            without = tuple(q for q in series.patches if q.name != p.name)
            try:
                tree(without)
                plans.append((f"minus-{p.name.removesuffix('.patch')}", without, f"the series without {p.name}"))
            except ApplyError as e:
                reason = str(e).splitlines()[0]
                plans.append((f"minus-{p.name.removesuffix('.patch')}", series.patches[:i],
                              f"the series up to {p.name} (without it a later patch does not apply: {reason})"))
        for name, what in BENCH_VARIANTS.items():
            extra = pin_dir(patches_root, version) / BENCH_VARIANTS_DIR / f"{name}.patch"
            if extra.is_file():
                plans.append((name, (*series.patches, Patch.load(extra)), what))
        for variant, patches, what in plans:
            files = tree(patches)
            (out / f"{variant}.tar.gz").write_bytes(tar_bytes(((n, d, 0o644) for n, d in files.items()), gz=True))
            if variant in BENCH_VARIANTS:
                shows: tuple[tuple[str, str, str | None], ...] = (("", "not a bug: " + what, None),)
            else:
                key = "stock" if variant == "stock" else f"{variant.removeprefix('minus-')}.patch"
                shows = expectations(version, key)
            expect, symptom, case = shows[0]
            manifest["variants"][variant] = {"what": what, "patches": [p.name for p in patches],
                                             "expect": expect, "symptom": symptom, "case": case,
                                             **({"jobs": [{"expect": e, "symptom": w, "case": c}
                                                          for e, w, c in shows]} if len(shows) > 1 else {})}
    (out / "variants.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
