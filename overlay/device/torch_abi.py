"""What a release's compiled kernels need of torch, against what the device's torch exports.

A vLLM wheel pins one torch (``Requires-Dist: torch==X``); the device machine has its own
(``scripts/device-packages.txt``: 2.11.0), and nothing can be installed there but what a carry
brings. A kernel built on torch's *stable* ABI links only against the C shim (``aoti_torch_*``,
``torch_*``): a shim function, once shipped, keeps its signature, so such a kernel loads on another
torch when every shim symbol it calls is exported there. A kernel built on torch's C++ ABI (mangled
``c10::``/``at::``/``torch::`` names) needs the torch it was built against.

:func:`check` reads the undefined dynamic symbols of each kernel that would travel (a small ELF
reader: no binutils needed) and compares the stable ones with the device torch's export list,
shipped as ``torch_exports/torch-<version>.txt`` (written from that torch's wheel by
``python -m overlay.device.torch_abi WHEEL``). :meth:`TorchCheck.line` says in one line what the
release needs and what fails on the device.
"""

from __future__ import annotations

import re
import struct
import sys
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

EXPORTS_DIR = Path(__file__).resolve().parent / "torch_exports"
STABLE_PREFIXES = ("aoti_", "torch_")  # torch's stable C ABI: the shim
# torch's C++ ABI: mangled names in the c10, c10d, at, torch and caffe2 namespaces (functions,
# const methods, typeinfo, vtables, typeinfo names, function-local statics)
CXX_SYMBOL = re.compile(r"^_Z(?:N|NK|TI|TV|TS|Z|ZN|ZNK)?(?:N|NK)?(?:3c10|4c10d|2at|5torch|6caffe2)")
_SHN_UNDEF = 0
_STB_LOCAL = 0
_STB_WEAK = 2
_SHT_DYNSYM = 11


def dynamic_symbols(data: bytes) -> tuple[set[str], set[str]] | None:
    """The (undefined, defined) global dynamic symbols of an ELF64 little-endian shared object;
    None when ``data`` is not one. Weak undefined symbols are left out: they may stay unresolved."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    try:
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        undefined: set[str] = set()
        defined: set[str] = set()
        for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
            if kind != _SHT_DYNSYM or not entsize:
                continue
            strtab = sections[link]
            strings = data[strtab[4]:strtab[4] + strtab[5]]
            for pos in range(offset + entsize, offset + size, entsize):  # entry 0 is the null symbol
                st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", data, pos)
                bind = st_info >> 4
                if not st_name or bind == _STB_LOCAL:
                    continue
                name = strings[st_name:strings.index(b"\0", st_name)].decode("ascii", "replace")
                if st_shndx == _SHN_UNDEF:
                    if bind != _STB_WEAK:
                        undefined.add(name)
                else:
                    defined.add(name)
        return undefined, defined
    except (struct.error, IndexError, ValueError):
        return None


def is_stable(symbol: str) -> bool:
    return symbol.startswith(STABLE_PREFIXES)


@dataclass(frozen=True)
class KernelNeed:
    """What one kernel needs of torch: ``abi`` "stable" (the C shim only), "c++" (torch's C++ ABI)
    or "none" (no torch symbol); ``missing``: the stable symbols the device's torch lacks."""

    path: str
    abi: str
    stable: int = 0
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class TorchCheck:
    """The release's torch pin, the device's torch, and each travelling kernel's needs."""

    release: str
    pinned: str | None  # the torch vLLM's Requires-Dist pins (None: no exact pin)
    device: str | None  # the device's torch (None: not in the device packages)
    exports: bool  # whether an export list of the device's torch was there to judge by
    kernels: tuple[KernelNeed, ...] = field(default_factory=tuple)

    def fails(self, need: KernelNeed) -> bool:
        """Whether ``need``'s kernel cannot load on the device's torch (as far as symbols tell)."""
        return bool(need.missing) or (need.abi == "c++" and self.pinned != self.device)

    def failing(self) -> list[KernelNeed]:
        return [k for k in self.kernels if self.fails(k)]

    def why(self, need: KernelNeed) -> str:
        """One kernel's failure, in words."""
        if need.missing:
            return (f"{need.path} needs {', '.join(need.missing)} (not exported by torch {self.device})")
        return f"{need.path} is built on torch's C++ ABI (torch {self.pinned} exactly)"

    def line(self, left_out: Iterable[str] = ()) -> str:
        """One line: what the release needs, what the device has, what fails (``left_out``: the failing
        kernels that stay home, vLLM loading them only if it can)."""
        head = f"vllm {self.release} needs torch {self.pinned or '(no exact pin)'}; the device has {self.device or '?'}"
        if self.pinned is not None and self.pinned == self.device:
            return f"{head}: the same torch"
        if self.device is None:
            return f"{head}: no torch in the device's packages: kernels not judged"
        if not self.exports:
            return f"{head}: no export list of torch {self.device} in {EXPORTS_DIR.name}/: kernels not judged"
        failing = self.failing()
        home = set(left_out)
        blocking = [k for k in failing if k.path not in home]
        ok = [k for k in self.kernels if not self.fails(k)]
        stable = [k for k in ok if k.abi == "stable"]
        parts = []
        if blocking:
            parts.append("; ".join(self.why(k) for k in blocking))
        else:
            count = f"all {len(ok)}" if len(ok) == len(self.kernels) else f"{len(ok)} of {len(self.kernels)}"
            parts.append(f"{count} kernels resolve against {self.device} ({len(stable)} on torch's stable ABI, "
                         f"{sum(k.stable for k in stable)} shim symbols; {len(ok) - len(stable)} without torch "
                         "symbols)")
        left = [k for k in failing if k.path in home]
        if left:
            parts.append("left out: " + "; ".join(self.why(k) for k in left))
        return f"{head}: {'; '.join(parts)}"

    def to_dict(self, left_out: Iterable[str] = ()) -> dict:
        return {"pinned": self.pinned, "device": self.device, "exports": self.exports, "line": self.line(left_out),
                "kernels": [{"path": k.path, "abi": k.abi, "stable_symbols": k.stable, "missing": list(k.missing)}
                            for k in self.kernels]}


def exports_file(version: str, root: Path = EXPORTS_DIR) -> Path:
    return root / f"torch-{version.split('+')[0]}.txt"


def read_exports(version: str, root: Path = EXPORTS_DIR) -> set[str] | None:
    """The stable-ABI symbols torch ``version`` exports (its shipped list), or None without one."""
    try:
        text = exports_file(version, root).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    return {ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")}


def kernel_need(path: str, data: bytes, exports: set[str] | None) -> KernelNeed | None:
    """What one kernel needs of torch; None when ``data`` is no ELF shared object."""
    symbols = dynamic_symbols(data)
    if symbols is None:
        return None
    undefined = symbols[0]
    stable = {s for s in undefined if is_stable(s)}
    cxx = {s for s in undefined if CXX_SYMBOL.match(s)}
    abi = "c++" if cxx else ("stable" if stable else "none")
    missing = tuple(sorted(stable - exports)) if exports is not None else ()
    return KernelNeed(path, abi, len(stable), missing)


def check(release: str, pinned: str | None, device: str | None, kernels: Mapping[str, bytes],
          exports_root: Path = EXPORTS_DIR) -> TorchCheck:
    """Each kernel of ``kernels`` (wheel path -> bytes) judged against the device torch's export list."""
    exports = read_exports(device, exports_root) if device else None
    needs = [kernel_need(p, d, exports) for p, d in sorted(kernels.items())]
    return TorchCheck(release, pinned, device, exports is not None, tuple(n for n in needs if n is not None))


def wheel_exports(torch_wheel: Path) -> list[str]:
    """The stable-ABI symbols every library of a torch wheel (``torch/lib/*.so*``) exports, sorted."""
    found: set[str] = set()
    with zipfile.ZipFile(torch_wheel) as zf:
        for name in zf.namelist():
            if name.startswith("torch/lib/") and ".so" in name.rsplit("/", 1)[-1]:
                symbols = dynamic_symbols(zf.read(name))
                if symbols is not None:
                    found |= {s for s in symbols[1] if is_stable(s)}
    return sorted(found)


def main(argv: list[str]) -> int:
    """``python -m overlay.device.torch_abi TORCH_WHEEL``: its export list on stdout."""
    if len(argv) != 1:
        print("usage: python -m overlay.device.torch_abi TORCH_WHEEL > overlay/device/torch_exports/"
              "torch-<version>.txt", file=sys.stderr)
        return 2
    from overlay.digest import of_file

    wheel = Path(argv[0])
    print(f"# the stable-ABI (aoti_*, torch_*) symbols exported by {wheel.name}'s torch/lib/*.so")
    print(f"# sha256 {of_file(wheel)}; written by python -m overlay.device.torch_abi WHEEL")
    print("\n".join(wheel_exports(wheel)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
