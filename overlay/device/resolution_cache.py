"""The resolution cache: a resolution is reused while its requirements, device pins, resolver and
index settings are the same."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path

from packaging.utils import canonicalize_name

from overlay import digest, jsonfile, textfile
from overlay.atomic import write_file
from overlay.device.resolve import RESOLVE_MAX_ROUNDS, DroppedPin, Resolution, ResolvedWheel, Resolver, target_args
from overlay.device.settings import DEVICE_ENV, PLATFORMS, STUB_LABEL, TORCH_FAMILY, DeviceStageError, log
from overlay.errors import one_line

RESOLUTION_CACHE_FORMAT = 1
# how extra requirements are resolved (in the key of such resolutions): on top of vLLM's own resolution,
# its dropped pins stay dropped, a device package is never staged older than the device's
EXTRA_POLICY = "over-vllm-resolution; no-downgrade; pure-sdist-builds"
# pip settings from the environment that change what it resolves (hashed into the key, never stored)
PIP_ENV_KEYS: tuple[str, ...] = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX",
                                 "PIP_CONSTRAINT", "PIP_PRE")


def resolution_key(requirements: Sequence[str], device: Mapping[str, str], resolver: Resolver, *,
                   platforms: Sequence[str] = PLATFORMS, max_rounds: int = RESOLVE_MAX_ROUNDS,
                   restore: bool = True, extra_requirements: Sequence[str] = (),
                   needs: Mapping[str, Sequence[str]] | None = None) -> str:
    """sha256 of everything :func:`resolve` depends on, not of the wheel: a patch edit changes the
    wheel's version and sha256 but not its ``Requires-Dist``, and so keeps the key. The
    ``--extra`` requirements and the device packages' recorded needs enter only when there are some
    (without, the key is what it was)."""
    inputs = {
        "format": RESOLUTION_CACHE_FORMAT,
        "requirements": list(requirements),
        "device_packages": sorted((canonicalize_name(k), v) for k, v in device.items()),
        "target": target_args(platforms),
        "markers": DEVICE_ENV,
        "resolver": [resolver.description, resolver.exact],
        "kept_pins": sorted(TORCH_FAMILY),
        "stub_label": STUB_LABEL,
        "max_rounds": max_rounds,
        "restore": restore,
        "pip_env": [os.environ.get(k, "") for k in PIP_ENV_KEYS],
    }
    if needs:
        inputs["device_needs"] = {k: list(v) for k, v in sorted(needs.items())}
    if extra_requirements:
        inputs["extra_requirements"] = list(extra_requirements)
        inputs["extra_policy"] = EXTRA_POLICY
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return digest.of_text(text)


def resolution_cache_file(cache: Path, key: str) -> Path:
    return cache / "device-resolutions" / f"{key}.json"


def _record(item: object, cls: type, optional: frozenset[str] = frozenset()) -> dict:
    """``item`` as the fields of dataclass ``cls``, every one a string (or None where ``optional``)."""
    names = [f.name for f in fields(cls)]
    if not isinstance(item, dict) or sorted(item) != sorted(names):
        raise ValueError(f"not a {cls.__name__}: {item!r}")
    for k, v in item.items():
        if not (isinstance(v, str) or (v is None and k in optional)):
            raise ValueError(f"{cls.__name__}.{k}: {v!r}")
    return item


def resolution_from_json(data: object, key: str) -> Resolution:
    """A :class:`Resolution` from :func:`save_resolution`'s JSON; ValueError if it is not one for ``key``."""
    if not isinstance(data, dict) or data.get("format") != RESOLUTION_CACHE_FORMAT or data.get("key") != key:
        raise ValueError("not a resolution of this format and key")
    rounds, restored, who = data["rounds"], data["restored"], data["required_by"]
    built = data.get("built", {})
    if (not isinstance(rounds, int) or not isinstance(restored, list) or not isinstance(who, dict)
            or not all(isinstance(r, str) for r in restored)
            or not all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in who.values())
            or not isinstance(built, dict) or not all(isinstance(v, str) for v in built.values())):
        raise ValueError("rounds, restored, required_by or built malformed")
    return Resolution([ResolvedWheel(**_record(w, ResolvedWheel, frozenset({"sha256"}))) for w in data["wheels"]],
                      [DroppedPin(**_record(d, DroppedPin)) for d in data["dropped"]],
                      rounds, list(restored), {k: list(v) for k, v in who.items()}, dict(built))


def load_resolution(path: Path, key: str) -> Resolution | None:
    """The cached resolution for ``key``; None if there is none, or (with a warning) if it is unreadable."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        textfile.refuse_link_out(path, path.parent, DeviceStageError, "a cached resolution is read from the cache only")
        return resolution_from_json(jsonfile.read(path, DeviceStageError, "a cached resolution"), key)
    except DeviceStageError as exc:
        log(f"  warning: cached resolution {path} unreadable ({str(exc).removeprefix(f'{path}: ')}); resolving again")
    except (ValueError, TypeError, KeyError) as exc:
        why = one_line(str(exc))
        log(f"  warning: cached resolution {path} unreadable ({type(exc).__name__}: "
            f"{why if len(why) <= 200 else why[:200] + '...'}); resolving again")
    return None


def save_resolution(path: Path, key: str, resolution: Resolution) -> None:
    """Write ``resolution`` as JSON, atomically."""
    data = {"format": RESOLUTION_CACHE_FORMAT, "key": key,
            "wheels": [asdict(w) for w in resolution.wheels], "dropped": [asdict(d) for d in resolution.dropped],
            "rounds": resolution.rounds, "restored": resolution.restored, "required_by": resolution.required_by,
            **({"built": resolution.built} if resolution.built else {})}
    write_file(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


