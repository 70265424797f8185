"""On the device machine: every installed distribution's version and Requires-Dist, as JSON.

    python3 scripts/device-requires.py > scripts/device-requires.json

``make device-stage`` gives the stub wheels that pin the device's packages these requirements, so pip
sees what a device package needs of a package the staging replaces (the device's transformers 5.17.0
needs huggingface-hub < 2.0; vLLM 0.34.0 needs >= 2.0): the pin that cannot hold is dropped and a
fitting version staged, instead of an engine that stops at import. Standard library only.
"""

from __future__ import annotations

import json
import re
import sys
from importlib.metadata import distributions


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> int:
    found: dict[str, dict[str, object]] = {}
    for dist in distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        found.setdefault(canonical(name), {"version": dist.version, "requires": sorted(dist.requires or [])})
    json.dump({"format": 1, "python": sys.version.split()[0], "packages": dict(sorted(found.items()))},
              sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
