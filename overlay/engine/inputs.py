"""The engine check's variant inputs, checked before anything runs, and a variant's tree laid out.

``--variant TAR`` must be a tarball of ``vllm/`` files; ``--variants DIR`` must be engine-variants'
output: a folder with a ``variants.json`` whose every variant with a case has its ``<name>.tar.gz``.
Anything else is an :class:`EngineCheckError` (exit 2) naming the path, before an engine starts.
"""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

from overlay import jsonfile
from overlay.errors import UsageError, shown_value
from overlay.outpaths import check_name


class EngineCheckError(UsageError):
    """The check cannot start: an unknown case, a missing variants folder (nothing ran; exit 2)."""


def _tarball(tar: Path, what: str) -> None:
    if not tar.is_file():
        raise EngineCheckError(f"{what} {tar}: {'is a folder, not a tarball' if tar.is_dir() else 'no such file'}")
    if not tarfile.is_tarfile(tar):
        raise EngineCheckError(f"{what} {tar}: not a tarball (make engine-variants writes them)")


def load_variants(variants: Path) -> dict[str, Any]:
    """``variants/variants.json``, checked: every variant has what a job needs and, with a case, its tarball."""
    what = "--variants"
    if not variants.is_dir():
        why = "is a file, not a folder" if variants.exists() else "no such folder"
        raise EngineCheckError(f"{what} {variants}: {why} (make engine-variants OUT=DIR writes one)")
    manifest = variants / "variants.json"
    if not manifest.exists():
        raise EngineCheckError(f"{what} {variants}: no variants.json in it: not engine-variants' output")
    doc = jsonfile.read(manifest, EngineCheckError, "engine-variants' variants.json")
    table = doc.get("variants")
    if not isinstance(table, dict):
        raise EngineCheckError(f"{manifest}: no 'variants' table: not engine-variants' output")
    for name, v in table.items():
        try:
            check_name(name)
        except ValueError as exc:  # it names the variant's tarball beside variants.json
            raise EngineCheckError(f"{manifest}: variants.{shown_value(name)}: not a variant name ({exc})") from None
        if not isinstance(v, dict) or not {"case", "expect", "symptom"} <= set(v):
            raise EngineCheckError(f"{manifest}: variants.{name}: wants case, expect and symptom")
        if v["case"]:
            _tarball(variants / f"{name}.tar.gz", f"{what}: variant {name}:")
    return doc


def check_inputs(variant: Path | None, variants: Path | None) -> None:
    """``--variant`` and ``--variants`` as they must be, before anything runs."""
    if variant is not None:
        _tarball(variant, "--variant")
    if variants is not None:
        load_variants(variants)


def lay_variant(tar: Path, dest: Path) -> Path:
    """A vLLM tree at ``dest`` that is the importable ``vllm`` with the files of ``tar`` swapped in.

    Every other file is a symlink into the installed package (compiled kernels included), so
    a variant costs a few hundred kilobytes. Returns ``dest`` (put it first on ``PYTHONPATH``).
    """
    import importlib.util
    import shutil
    import tarfile

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise EngineCheckError("--variant/--variants: needs an importable vllm to lay the variant over")
    src = Path(spec.origin).parent
    if dest.exists():
        shutil.rmtree(dest)
    for path in src.rglob("*"):
        if "__pycache__" in path.parts or path.is_dir():
            continue
        link = dest / "vllm" / path.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)
    with tarfile.open(tar) as tf:
        for member in tf.getmembers():
            if not member.isfile() or not member.name.startswith("vllm/") or ".." in Path(member.name).parts:
                raise EngineCheckError(f"{tar}: unexpected member {member.name!r}")
            target = dest / member.name
            target.unlink(missing_ok=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            data = tf.extractfile(member)
            assert data is not None
            target.write_bytes(data.read())
    return dest
