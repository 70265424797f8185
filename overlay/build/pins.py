"""``Pin``: the base release a series applies to (version, wheel file name, sha256, its torch).

Read from and written to ``patches/<version>/pin.toml``. ``torch`` is the release's own exact torch pin
(its wheel's ``Requires-Dist: torch==X``), written here so that the Makefile can make the tool's
environment on that torch before any Python of ours runs; the build refuses a pin whose ``torch``
differs from the wheel's (:func:`overlay.build.install.check_torch_pin`).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from overlay import textfile
from overlay.errors import PinError, shown

INSIDE_PATCHES = "a series, pin or patch is read only from inside the patches folder: put the file itself there"
"""How a file under ``patches/`` reached through a link out of that folder is refused
(:func:`overlay.textfile.refuse_link_out`)."""
_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")
_VERSION = re.compile(r"^\d+\.\d+\.\d+(?:\.post\d+|rc\d+)?\Z")  # \Z: "$" lets a trailing newline through
_TORCH = re.compile(r"^\d+\.\d+\.\d+\Z")
_PARTS = re.compile(r"^(?P<major>\d+)\.(?P<minor>\d+)\.(?P<patch>\d+)(?:\.post(?P<post>\d+)|rc(?P<rc>\d+))?\Z")


@dataclass(frozen=True)
class Pin:
    """One pinned vLLM release."""

    version: str
    wheel: str
    sha256: str
    sdist: str | None = None
    sdist_sha256: str | None = None
    torch: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, object], source: str) -> Pin:
        """Validate ``data``; every problem is collected before raising."""
        problems: list[str] = []

        def text(key: str, required: bool) -> str | None:
            value = data.get(key)
            if value is None:
                if required:
                    problems.append(f"missing field {key!r}")
                return None
            if not isinstance(value, str):
                problems.append(f"field {key!r} must be a string, got {type(value).__name__}")
                return None
            return value

        version = text("version", True)
        wheel = text("wheel", True)
        sha256 = text("sha256", True)
        sdist = text("sdist", False)
        sdist_sha256 = text("sdist_sha256", False)
        torch = text("torch", False)
        unknown = sorted(set(data) - {"version", "wheel", "sha256", "sdist", "sdist_sha256", "torch"})
        if unknown:
            problems.append(f"unknown field(s) {', '.join(shown(str(k)) for k in unknown)}")
        if version is not None and not _VERSION.match(version):
            problems.append(f"field 'version' is not a release version: {shown(version)}")
        if sha256 is not None and not _SHA256.match(sha256):
            problems.append(f"field 'sha256' is not 64 lowercase hex digits: {shown(sha256)}")
        if sdist_sha256 is not None and not _SHA256.match(sdist_sha256):
            problems.append(f"field 'sdist_sha256' is not 64 lowercase hex digits: {shown(sdist_sha256)}")
        if torch is not None and not _TORCH.match(torch):
            problems.append(f"field 'torch' is not a torch release like 2.14.0: {shown(torch)}")
        if wheel is not None and version is not None and _VERSION.match(version):
            if not (wheel.startswith(f"vllm-{version}-") and wheel.endswith(".whl")):
                problems.append(f"field 'wheel' {shown(wheel)} is not a vllm {version} wheel file name")
        if problems:
            raise PinError(f"{source}: " + "; ".join(problems))
        assert version and wheel and sha256
        return cls(version, wheel, sha256, sdist, sdist_sha256, torch)

    @classmethod
    def load(cls, path: Path, patches_root: Path | None = None) -> Pin:
        """Read and validate ``path``, a file inside ``patches_root`` (default: the folder above its own) even
        with its links followed: one out of it is refused unread."""
        textfile.refuse_link_out(path, patches_root or path.parent.parent, PinError, INSIDE_PATCHES)
        if path.is_dir():
            raise PinError(f"{path}: is a directory, not a pin file; remove it and write the pin there "
                           "(version, wheel, sha256)")
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise PinError(f"{path}: no pin file (is this release in patches/?)") from None
        except OSError as exc:
            raise PinError(f"{path}: cannot read the pin file: {exc.strerror}") from None
        text = textfile.decode(raw, str(path), PinError)
        textfile.refuse_empty(text, str(path), PinError, "a pin (version, wheel, sha256)")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise PinError(f"{path}: not valid TOML: {exc}") from None
        return cls.from_dict(data, str(path))

    def to_toml(self) -> str:
        """Serialize in a fixed field order (stable diffs)."""
        lines = [
            "# The base release this series applies to. The wheel is fetched from the package",
            "# registry through pip and verified against sha256 before anything reads it.",
            f'version = "{self.version}"',
            f'wheel = "{self.wheel}"',
            f'sha256 = "{self.sha256}"',
        ]
        if self.sdist:
            lines.append(f'sdist = "{self.sdist}"')
        if self.sdist_sha256:
            lines.append(f'sdist_sha256 = "{self.sdist_sha256}"')
        if self.torch:
            lines.append("# The release's own torch pin (its wheel's Requires-Dist), which its environment is made on.")
            lines.append(f'torch = "{self.torch}"')
        return "\n".join(lines) + "\n"


DEFAULT_FILE = "DEFAULT"  # patches/DEFAULT: the release the tools use when none is named


REPO_PATCHES = Path(__file__).resolve().parents[2] / "patches"


def default_version(patches_root: Path) -> str:
    """The default release: the one line of ``<patches_root>/DEFAULT`` (read by the CLI, the
    Makefile, the engine variants and the tests; the Dockerfile's ``VLLM_VERSION`` default matches it).
    A patches folder without its own ``DEFAULT`` (a synthetic one) takes the repository's."""
    path = patches_root / DEFAULT_FILE
    if not path.exists() and not path.is_symlink():
        path = REPO_PATCHES / DEFAULT_FILE
    textfile.refuse_link_out(path, path.parent, PinError, INSIDE_PATCHES)
    try:
        text = textfile.decode(path.read_bytes(), str(path), PinError).strip()
    except OSError as exc:
        raise PinError(f"{path}: cannot read the default release ({exc.strerror or exc})") from None
    if not _VERSION.match(text):
        raise PinError(f"{path}: expected one release like 0.28.0, got {shown(text)}")
    return text


def check_version(text: str, what: str) -> str:
    """``text`` when it is a release version like 0.30.0, else a one-line ``PinError`` naming ``what``."""
    if not _VERSION.match(text):
        raise PinError(f"{what}: {text!r} is not a release version like 0.30.0")
    return text


def release_order(version: str) -> tuple[int, ...]:
    """A sort key of a release version (:func:`check_version`'s form): ``0.29.0rc1 < 0.29.0 < 0.29.0.post1``."""
    m = _PARTS.match(version)
    if m is None:
        raise PinError(f"{version!r} is not a release version like 0.30.0")
    rc, post = m["rc"], m["post"]
    return (int(m["major"]), int(m["minor"]), int(m["patch"]), 0 if rc else 1, int(rc or 0), int(post or 0))


def is_release(text: str) -> bool:
    """Whether ``text`` is a release version like 0.30.0 (:func:`check_version`'s form), as a folder name."""
    return bool(_VERSION.match(text))


def carried_releases(patches_root: Path) -> list[str]:
    """Every release ``patches_root`` carries (a folder named as a release with a ``pin.toml`` and a
    ``series``), oldest first: what the tools and tests walk, none of them naming a release by value."""
    found = [p.name for p in patches_root.iterdir()
             if is_release(p.name) and (p / "pin.toml").is_file() and (p / "series").is_file()]
    return sorted(found, key=release_order)


def pin_dir(patches_root: Path, version: str) -> Path:
    """The folder holding a release's ``pin.toml``, ``series`` and patches."""
    return patches_root / version


def load_pin(patches_root: Path, version: str) -> Pin:
    """Load ``patches/<version>/pin.toml`` and check it pins ``version``."""
    pin = Pin.load(pin_dir(patches_root, version) / "pin.toml", patches_root)
    if pin.version != version:
        raise PinError(
            f"{pin_dir(patches_root, version) / 'pin.toml'}: field 'version' is "
            f"{pin.version!r} but the folder is {version!r}"
        )
    return pin
