"""A profile's YAML, loaded without aliases and with a bound on its size.

A YAML alias (``*name``) repeats a node without copying it: ten lines of nested aliases stand for
a billion strings, which loading keeps small but anything that walks the value (formatting it into
an error line, checking every item) expands until memory runs out. Profiles need none, so an alias
is refused at its line; the file itself is bounded too (:data:`MAX_BYTES`, shipped profiles are a few
KiB). A key given twice in one mapping (PyYAML keeps the last without a word: a second
``thresholds:`` replaced the first) is refused too. Each is a
:class:`overlay.regress.errors.ProfileError` naming the file and the line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from overlay import textfile
from overlay.errors import shown_value
from overlay.regress.errors import ProfileError

MAX_BYTES = 1 << 20  # 1 MiB


class _NoAliases(yaml.SafeLoader):
    """PyYAML's safe loader that stops at the first alias."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"an alias (*{event.anchor}): aliases are not allowed in a profile (a few lines "
                            "of them can stand for gigabytes); write the value out", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """A mapping whose keys are all different: PyYAML keeps the last of two, silently."""
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                line = first.setdefault(key, key_node.start_mark.line)
            except TypeError:  # an unhashable key: the base class says so
                break
            if line != key_node.start_mark.line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{shown_value(key)} is given twice (first on line {line + 1}); keep one",
                    key_node.start_mark)
        return super().construct_mapping(node, deep)


def loads(text: str, source: str) -> Any:
    """The YAML document ``text``; invalid YAML or an alias is one :class:`ProfileError` naming its line."""
    if len(text) > MAX_BYTES:
        raise ProfileError(f"{source}: {len(text)} characters, more than a profile may hold ({MAX_BYTES})")
    try:
        return yaml.load(text, Loader=_NoAliases)  # a SafeLoader
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (a NUL, a control character)
        line = text[:exc.position].count("\n") + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise ProfileError(f"{source}: line {line} not valid YAML: the character U+{code:04X} "
                           "(YAML allows printable characters, tab and newlines only)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ProfileError(f"{source}:{where} not valid YAML: {problem}") from None


def read(path: Path) -> str:
    """A profile file's text: UTF-8 (a UTF-8 byte-order mark is YAML's own and allowed), at most
    :data:`MAX_BYTES` (only that much is read)."""
    with path.open("rb") as f:
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise ProfileError(f"{path}: larger than a profile may be ({MAX_BYTES} bytes)")
    return textfile.decode(raw, str(path), ProfileError, bom_ok=True)
