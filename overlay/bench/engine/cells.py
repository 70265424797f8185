"""bench-engine's cells (batch x context, mixed) and the order of the measured rounds."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from overlay.bench.engine.common import ORDERS, TAIL_TOKENS


@dataclass(frozen=True)
class Cell:
    """One measured configuration: ``batch`` requests of ``context`` tokens, or the mixed load."""

    batch: int
    context: int
    mixed: bool = False

    @property
    def name(self) -> str:
        return "mixed" if self.mixed else f"{self.batch}x{self.context}"


def parse_cells(spec: str | None, batches: list[int], contexts: list[int], *, mixed_batch: int,
                mixed_context: int, mixed: bool = True) -> list[Cell]:
    """The cells to run: ``batches`` x ``contexts`` smallest context first (mixed after the cells of
    its context), or ``spec`` (``--cells``: ``1x4096,8x16384,mixed``) in the order given (under
    ``--budget`` the first ones are the ones that run).
    """
    cells: list[Cell] = []
    if spec:
        for item in filter(None, (s.strip() for s in spec.split(","))):
            if item == "mixed":
                cells.append(Cell(mixed_batch, mixed_context, mixed=True))
                continue
            m = re.fullmatch(r"(\d+)x(\d+)", item)
            if not m or int(m.group(1)) < 1 or int(m.group(2)) <= TAIL_TOKENS:
                raise ValueError(f"--cells: {item!r} is not BATCHxCONTEXT (context > {TAIL_TOKENS}) or 'mixed'")
            cells.append(Cell(int(m.group(1)), int(m.group(2))))
        if not cells:
            raise ValueError(f"--cells {spec!r}: no cell in it (BATCHxCONTEXT or 'mixed', comma-separated)")
    else:
        for b in batches:
            for c in contexts:
                if b < 1 or c <= TAIL_TOKENS:
                    raise ValueError(f"batch {b} x context {c}: want batch >= 1 and context > {TAIL_TOKENS}")
        cells = [Cell(b, c) for c in contexts for b in batches]
        if mixed:
            cells.append(Cell(mixed_batch, mixed_context, mixed=True))
    if len({c.name for c in cells}) != len(cells):
        raise ValueError("--cells: a cell is named twice")
    if spec:
        return cells
    return sorted(cells, key=lambda c: (c.context, c.mixed, c.batch))


def round_order(k: int, servers: int = 2) -> tuple[str, ...]:
    """The order of round ``k``'s runs: AB, BA, AB, ... for two servers; ABC, BCA, CAB, CBA, BAC, ACB, ...
    with the twin."""
    orders = ORDERS[servers]
    return orders[k % len(orders)]


def abba(repeats: int, servers: int = 2) -> list[str]:
    """The measured runs' order: ``repeats`` rounds (runs per server) of ``round_order``."""
    return [side for k in range(repeats) for side in round_order(k, servers)]


def cell_prompts(cell: Cell, seed: int) -> list[list[int]]:
    """``cell.batch`` prompts of ``cell.context`` byte tokens: one shared prefix, 32 own tokens each."""
    rng = random.Random(f"bench-engine:{seed}:{cell.context}:{cell.batch}:{cell.mixed}")
    prefix = [rng.randrange(256) for _ in range(cell.context - TAIL_TOKENS)]
    return [prefix + [rng.randrange(256) for _ in range(TAIL_TOKENS)] for _ in range(cell.batch)]


def fresh_prompt(context: int, seed: int, tag: str) -> list[int]:
    """A prompt no other request shares (the mixed cell's arriving prefills)."""
    rng = random.Random(f"bench-engine:fresh:{seed}:{tag}")
    return [rng.randrange(256) for _ in range(context)]


