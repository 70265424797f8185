"""``make image-smoke``: build our image on a CPU stand-in of the official base, run it, check it.

Steps (each says what it does and how long it took): the stand-in (:mod:`overlay.image.standin`), our
image over it from ``docker/Dockerfile`` with the plan ``make image`` uses (only ``BASE_IMAGE``
differs), then three checks of the result against the series, reported together:

- labels and entrypoint: the base, the series tag, the patches in order, the version; the
  official entrypoint (``vllm serve``) kept;
- inside a container (``scripts/image-smoke.py``, copied into the image by the Dockerfile):
  ``vllm.__version__`` and ``vllm/_overlay.json`` are the series' ``<base>+ovl...``, exactly one
  vLLM dist-info, every patch's added lines (:func:`expected_lines`, derived from the patch
  files) are lines of the installed files, and ``vllm --help`` runs (CPU platform);
- the entrypoint: ``vllm serve`` of a model that is not there (offline) starts, logs our version
  and stops at the model, which is as far as a CPU-only machine without weights goes.

``negative`` builds a wrong image on purpose, and the smoke must then fail: ``version`` passes a
wrong ``OVERLAY_VERSION`` (the image build's own smoke step stops it), ``patch`` builds the wheel
of the series without its last patch (the checks name the patch whose lines are missing).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from overlay.atomic import scratch
from overlay.build.pins import pin_dir
from overlay.build.series import Series, is_package_path
from overlay.errors import OverlayError
from overlay.image.containers import Engine, describe, last_line
from overlay.image.plan import Plan, build_image, plan_image
from overlay.image.standin import REPOSITORY, build_standin, mmdebstrap

SMOKE_IN_IMAGE = "/usr/local/share/vllm-overlay/image-smoke.py"  # where docker/Dockerfile puts it
SMOKE_IMAGE = "localhost/vllm-overlay-smoke"
ENTRYPOINT = ["vllm", "serve"]
NO_MODEL = "vllm-overlay/no-such-model"  # served offline: the server starts and stops at the model
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_DISABLE_LOG_LOGO": "1"}
NEGATIVE_CASES = ("version", "patch")
RUN_TIMEOUT = 600


class ImageSmokeError(OverlayError):
    """The image did not build, or a check of it failed (all failures in one line)."""


def expected_lines(series: Series) -> dict[str, dict[str, list[str]]]:
    """Per patch, per package file: the non-blank lines it adds that no later patch removes."""
    out: dict[str, dict[str, list[str]]] = {}
    for i, patch in enumerate(series.patches):
        for diff in patch.files:
            path = diff.new_path
            if path is None or not is_package_path(path) or not path.startswith("vllm/"):
                continue
            later = {ln.strip() for p in series.patches[i + 1:] for d in p.files if d.path == path
                     for ln in d.removed}
            keep = list(dict.fromkeys(ln.strip() for ln in diff.added if ln.strip() and ln.strip() not in later))
            if keep:
                out.setdefault(patch.name, {}).setdefault(path, []).extend(keep)
    return out


@dataclass(frozen=True)
class Expected:
    """What the checks compare the image with: always the real series."""

    version: str
    base: str
    tag: str
    patches: tuple[str, ...]
    base_name: str
    lines: dict[str, dict[str, list[str]]]


def check_config(config: dict[str, object], want: Expected) -> list[str]:
    """Problems with the image's labels and entrypoint."""
    labels = config.get("Labels") or {}
    assert isinstance(labels, dict)
    wanted = {
        "org.opencontainers.image.version": want.version,
        "org.opencontainers.image.base.name": want.base_name,
        "vllm-overlay.base-version": want.base,
        "vllm-overlay.series-tag": want.tag,
        "vllm-overlay.patches": " ".join(want.patches),
    }
    problems = [f"label {k} is {labels.get(k)!r}, expected {v!r}" for k, v in wanted.items() if labels.get(k) != v]
    if config.get("Entrypoint") != ENTRYPOINT:
        problems.append(f"entrypoint is {config.get('Entrypoint')!r}, expected {ENTRYPOINT!r}")
    return problems


def check_serve(output: str, rc: int, version: str) -> list[str]:
    """Problems with the entrypoint's run: it must log our version and the model before it stops."""
    want = f"vLLM server version {version}, serving model {NO_MODEL}"
    if want in output:
        return []
    seen = next((ln.strip() for ln in output.splitlines() if "vLLM server version" in ln), "")
    return [f"`vllm serve` (entrypoint) exit {rc} without {want!r}: "
            + (f"it logged {seen!r}" if seen else last_line(output))]


def _step(n: int, message: str) -> None:
    print(f"image-smoke: [{n}/5] {message}", file=sys.stderr, flush=True)


@contextmanager
def _without_last_patch(patches_root: Path, version: str) -> Iterator[tuple[Path, str]]:
    """A copy of the release folder whose series leaves out its last patch, and that patch's name."""
    src = pin_dir(patches_root, version)
    series = Series.load(src)
    if not series.patches:
        raise ImageSmokeError(f"{series.series_file}: no patch to leave out for the negative case")
    dropped = series.patches[-1].name
    with scratch("image-smoke-") as tmp:
        dest = Path(tmp) / src.name
        shutil.copytree(src, dest)
        names = [p.name for p in series.patches[:-1]]
        (dest / "series").write_text(Series.render(names))
        (dest / dropped).unlink()
        yield Path(tmp), dropped


def preflight(engine: Engine) -> str:
    """Whether the smoke can run here: its line, or a one-line error (no engine was already one)."""
    mmdebstrap()
    return f"image-smoke can run here: engine {describe(engine)}, mmdebstrap"


def smoke(patches_root: Path, version: str, *, engine: Engine, repo: Path, dist: Path, negative: str = "",
          keep: bool = False, torch: str = "") -> list[str]:
    """Run the smoke; return its ``ok`` lines, or raise :class:`ImageSmokeError` naming every failure."""
    if negative and negative not in NEGATIVE_CASES:
        raise ImageSmokeError(f"NEGATIVE {negative!r} is not one of {', '.join(NEGATIVE_CASES)}")
    t_all = time.perf_counter()
    print(f"image-smoke: engine {describe(engine)}", file=sys.stderr, flush=True)
    _step(1, "stand-in base (docker/standin-base/)")
    t0 = time.perf_counter()
    base = build_standin(engine, repo, patches_root, version, torch=torch)
    times = {"stand-in": time.perf_counter() - t0}
    real = plan_image(patches_root, version, dist=dist, image=SMOKE_IMAGE, base_image=REPOSITORY)
    want = Expected(real.overlay_version, real.version, real.tag, real.patches, base,
                    expected_lines(Series.load(pin_dir(patches_root, version))))
    with _negative(negative, patches_root, version, dist, real) as (root, plan, note):
        _step(2, f"our image over {base}" + (f" ({note})" if note else ""))
        t0 = time.perf_counter()
        built = build_image(plan, root, dist, engine)
        times["image build"] = time.perf_counter() - t0
        if built.returncode != 0:
            said = [ln.strip() for ln in built.stdout.splitlines() if ln.strip().startswith("smoke: ")]
            raise ImageSmokeError(f"image build failed (exit {built.returncode})"
                                  + (f": its smoke step says {said[-1]}" if said else f": {last_line(built.stdout)}"))
        image = plan.image_tags[0]
        try:
            problems, oks = _checks(engine, image, want, times)
        finally:
            for cmd in ([] if keep else [engine.remove_command(image)]) + engine.prune_commands():
                engine.call(cmd, capture=True)
    times["total"] = time.perf_counter() - t_all
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
    if problems:
        raise ImageSmokeError("; ".join(problems) + f" ({timing})")
    return [*oks, f"image-smoke: ok ({timing})" + (f"; kept {image}" if keep else "")]


@contextmanager
def _negative(case: str, patches_root: Path, version: str, dist: Path,
              real: Plan) -> Iterator[tuple[Path, Plan, str]]:
    """The release folder and plan to build: the real ones, or a negative case's."""
    if case == "version":
        wrong = f"{real.version}+ovl0000000000"
        yield patches_root, dataclasses.replace(real, overlay_version=wrong), f"negative case: OVERLAY_VERSION={wrong}"
    elif case == "patch":
        with _without_last_patch(patches_root, version) as (root, dropped):
            plan = plan_image(root, version, dist=dist, image=SMOKE_IMAGE, base_image=REPOSITORY)
            try:
                yield root, plan, f"negative case: the series without {dropped}"
            finally:
                (dist / Path(plan.wheel).name).unlink(missing_ok=True)
    else:
        yield patches_root, real, ""


def _checks(engine: Engine, image: str, want: Expected, times: dict[str, float]) -> tuple[list[str], list[str]]:
    problems: list[str] = []
    oks: list[str] = []
    _step(3, f"labels and entrypoint of {image}")
    found = check_config(engine.config(image), want)
    problems += found
    if not found:
        oks.append(f"smoke: ok labels (base {want.base_name}, series {want.tag}, {len(want.patches)} patches), "
                   f"entrypoint {' '.join(ENTRYPOINT)}")
    _step(4, "inside: version, one dist-info, every patch's added lines, vllm --help")
    t0 = time.perf_counter()
    args = [SMOKE_IN_IMAGE, "--version", want.version, "--base", want.base, "--tag", want.tag, "--expect", "-", "--cli"]
    proc = engine.run(image, args, entrypoint=["python3"], input_text=json.dumps(want.lines), timeout=RUN_TIMEOUT)
    times["inside"] = time.perf_counter() - t0
    said = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip().startswith("smoke: ")]
    if proc.returncode == 0 and said:
        oks.append(said[-1])
    else:
        problems.append(said[-1] if said else f"in-image smoke exit {proc.returncode}: {last_line(proc.stdout)}")
    _step(5, f"entrypoint: vllm serve {NO_MODEL} (CPU, offline)")
    t0 = time.perf_counter()
    proc = engine.run(image, [NO_MODEL], env=CPU_ENV, timeout=RUN_TIMEOUT)
    times["serve"] = time.perf_counter() - t0
    found = check_serve(proc.stdout, proc.returncode, want.version)
    problems += found
    if not found:
        oks.append(f"smoke: ok `vllm serve` started as vLLM {want.version} and stopped at the absent model "
                   f"(exit {proc.returncode})")
    return problems, oks
