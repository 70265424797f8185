"""Tests of the test-only ``deep_gemm`` stand-in (``tests/engine/standin``).

Every function is checked against independently written naive formulas (Python loops in float64
over small sizes); the paged K cache is written byte by byte the way vLLM's CUDA writer lays it out
(``_fp8_quant_and_cache_write``, ``vllm/models/deepseek_v32/common/kernels.py``). Further tests
check that vLLM's own wrapper ``vllm.utils.deep_gemm`` resolves the stand-in, routes the three
indexer kernels to it and nothing else, and keeps DeepGEMM E8M0 scaling off. The ``gpu`` test
captures the paged logits in a CUDA graph.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

STANDIN = Path(__file__).resolve().parent / "standin"
REPO_PATCHES = Path(__file__).resolve().parents[2] / "patches"
FP8 = torch.float8_e4m3fn
NEG_INF = float("-inf")
LOGITS_FUNCS = {"fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "get_paged_mqa_logits_metadata"}


def _load_standin() -> ModuleType:
    """The stand-in under a private name (so it never shadows a real ``deep_gemm`` here)."""
    path = STANDIN / "deep_gemm" / "__init__.py"
    spec = importlib.util.spec_from_file_location("_deep_gemm_standin_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dg = _load_standin()


# ---------------------------------------------------------------- naive references and checks


def _fp8(shape: tuple[int, ...], gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * 2).to(FP8).to(device)


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _score(q_heads: list[list[float]], k: list[float], scale: float, weights: list[float]) -> float:
    """sum_h relu((q_h . k) * scale) * w_h, in float64."""
    return sum(max(0.0, _dot(q_h, k) * scale) * w_h for q_h, w_h in zip(q_heads, weights, strict=True))


def naive_mqa_logits(
    q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor, ks: list[int], ke: list[int]
) -> torch.Tensor:
    qf, kf, sf, wf = q.float().tolist(), k.float().tolist(), k_scale.tolist(), weights.tolist()
    rows = []
    for m in range(q.shape[0]):
        rows.append(
            [_score(qf[m], kf[n], sf[n], wf[m]) if ks[m] <= n < ke[m] else NEG_INF for n in range(k.shape[0])]
        )
    return torch.tensor(rows, dtype=torch.float64).reshape(q.shape[0], k.shape[0])


def assert_logits_match(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    assert tuple(got.shape) == tuple(ref.shape)
    got, ref = got.cpu(), ref.cpu()
    ref_masked = torch.isneginf(ref)
    wrong = torch.isneginf(got) != ref_masked
    assert not wrong.any(), f"-inf at the wrong positions: {wrong.nonzero().tolist()[:10]}"
    assert torch.isfinite(got[~ref_masked]).all(), "non-finite logits at valid positions"
    torch.testing.assert_close(got.double()[~ref_masked], ref[~ref_masked], rtol=1e-5, atol=1e-4)


def logits_match(got: torch.Tensor, ref: torch.Tensor) -> bool:
    try:
        assert_logits_match(got, ref)
    except AssertionError:
        return False
    return True


# ---------------------------------------------------------------- non-paged (prefill) logits

# Rows: full range, empty (ks == ke), inverted (ks > ke), inner window, prefix, single key.
KS = [0, 3, 6, 2, 0, 8]
KE = [9, 3, 4, 5, 7, 9]


@dataclass
class MqaCase:
    q: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    weights: torch.Tensor
    ks: torch.Tensor
    ke: torch.Tensor

    def ref(self) -> torch.Tensor:
        return naive_mqa_logits(self.q, self.k, self.k_scale, self.weights, self.ks.tolist(), self.ke.tolist())


def make_mqa_case(device: str = "cpu", seed: int = 0) -> MqaCase:
    gen = torch.Generator().manual_seed(seed)
    m, h, d, n = len(KS), 3, 16, 9
    return MqaCase(
        q=_fp8((m, h, d), gen, device),
        k=_fp8((n, d), gen, device),
        k_scale=(0.25 + 4 * torch.rand(n, generator=gen)).to(device),
        weights=torch.randn(m, h, generator=gen).to(device),
        ks=torch.tensor(KS, dtype=torch.int32, device=device),
        ke=torch.tensor(KE, dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize("budget", [None, 1, 3 * 9 * 2], ids=["one-chunk", "row-per-chunk", "two-rows"])
def test_mqa_logits_match_naive_formula(budget: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if budget is not None:
        monkeypatch.setattr(dg, "_ELEMENT_BUDGET", budget)
    c = make_mqa_case()
    got = dg.fp8_fp4_mqa_logits((c.q, None), (c.k, c.k_scale), c.weights, c.ks, c.ke, clean_logits=False)
    assert_logits_match(got, c.ref())


def test_mqa_logits_accept_n_by_1_scales_and_clean_flag() -> None:
    c = make_mqa_case(seed=1)
    a = dg.fp8_fp4_mqa_logits((c.q, None), (c.k, c.k_scale), c.weights, c.ks, c.ke, clean_logits=True)
    b = dg.fp8_fp4_mqa_logits((c.q, None), (c.k, c.k_scale[:, None]), c.weights, c.ks, c.ke, clean_logits=False)
    assert torch.equal(a, b)
    assert_logits_match(b, c.ref())


def compressed(full: torch.Tensor, ks: list[int], ke: list[int], width: int) -> torch.Tensor:
    """vLLM 0.33.0's form of ``full``: row m, column j is key ks[m] + j, -inf from ke[m] - ks[m] on."""
    out = torch.full((full.shape[0], width), NEG_INF, dtype=full.dtype)
    for m in range(full.shape[0]):
        n = max(0, min(width, ke[m] - ks[m]))
        out[m, :n] = full[m, ks[m]:ks[m] + n]
    return out


@pytest.mark.parametrize("budget", [None, 1], ids=["one-chunk", "row-per-chunk"])
def test_mqa_logits_compressed_form_of_0_33_0(budget: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33.0 passes max_seqlen_k as the sixth argument and reads [M, max_seqlen_k] logits whose
    column j of row m is key ks[m] + j (sparse_attn_indexer gives top-k the row lengths ke - ks)."""
    if budget is not None:
        monkeypatch.setattr(dg, "_ELEMENT_BUDGET", budget)
    c = make_mqa_case(seed=3)
    width = max(e - s for s, e in zip(KS, KE, strict=True))
    ref = compressed(c.ref(), KS, KE, width)
    positional = dg.fp8_fp4_mqa_logits((c.q, None), (c.k, c.k_scale), c.weights, c.ks, c.ke, width)
    assert_logits_match(positional, ref)
    keyword = dg.fp8_fp4_mqa_logits((c.q, None), (c.k, c.k_scale), c.weights, c.ks, c.ke, max_seqlen_k=width)
    assert torch.equal(positional, keyword)
    # the full form (0.28.0's bool) is not this: a stand-in that ignored the int would fail here
    full = dg.fp8_fp4_mqa_logits((c.q, None), (c.k, c.k_scale), c.weights, c.ks, c.ke, True)
    assert full.shape == (len(KS), c.k.shape[0]) and not logits_match(full, ref)
    wider = dg.fp8_fp4_mqa_logits((c.q, None), (c.k, c.k_scale), c.weights, c.ks, c.ke, width + 3)
    assert_logits_match(wider, compressed(c.ref(), KS, KE, width + 3))


def test_logits_dtype_of_0_34_0() -> None:
    """vLLM 0.34.0 passes ``logits_dtype`` to both logits kernels (float32 off SM100, bfloat16 on it):
    float32 is the default form, bfloat16 its rounding, anything else refused as DeepGEMM does."""
    c = make_mqa_case(seed=4)
    width = max(e - s for s, e in zip(KS, KE, strict=True))
    args = ((c.q, None), (c.k, c.k_scale), c.weights, c.ks, c.ke, width)
    plain = dg.fp8_fp4_mqa_logits(*args)
    assert torch.equal(dg.fp8_fp4_mqa_logits(*args, logits_dtype=torch.float32), plain)
    half = dg.fp8_fp4_mqa_logits(*args, logits_dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, plain.to(torch.bfloat16))
    with pytest.raises(TypeError, match=r"logits_dtype must be float32 or bfloat16, got torch\.float16"):
        dg.fp8_fp4_mqa_logits(*args, logits_dtype=torch.float16)

    case = make_paged_case(**PAGED_CASES["next2-2d"], seed=5)  # type: ignore[arg-type]
    cache = case.cache()
    paged = case.call(cache)
    assert torch.equal(case.call(cache, logits_dtype=torch.float32), paged)
    paged_half = case.call(cache, logits_dtype=torch.bfloat16)
    assert paged_half.dtype == torch.bfloat16 and torch.equal(paged_half, paged.to(torch.bfloat16))
    with pytest.raises(TypeError, match="logits_dtype must be float32 or bfloat16"):
        case.call(cache, logits_dtype=torch.float16)


def _wrapper_functions(release: str, names: tuple[str, ...], impls: dict[str, object]) -> dict[str, object]:
    """``names`` from ``release``'s own ``vllm/utils/deep_gemm.py`` (its source text, compiled here),
    their ``_*_impl`` globals bound to ``impls``: the calls that wheel makes into DeepGEMM, as written."""
    import ast

    from overlay.maintain.trees import base_tree

    path = base_tree(REPO_PATCHES, release) / "vllm" / "utils" / "deep_gemm.py"
    tree = ast.parse(path.read_text())
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {d.name for d in defs} == set(names), f"{path}: {names} not all defined"
    namespace: dict[str, object] = {"torch": torch, "_lazy_init": lambda: None, **impls}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in names}


@pytest.mark.slow
def test_standin_takes_the_call_form_of_0_34_0s_wrapper() -> None:
    """0.34.0's wrapper passes ``logits_dtype=`` to both kernels (the engine's first dummy run failed on
    the device with ``unexpected keyword argument 'logits_dtype'`` before the stand-in took it); called
    through that wrapper's own code, as ``sparse_attn_indexer`` calls it, the logits are right."""
    funcs = _wrapper_functions(
        "0.34.0",
        ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits"),
        {"_fp8_fp4_mqa_logits_impl": dg.fp8_fp4_mqa_logits,
         "_fp8_fp4_paged_mqa_logits_impl": dg.fp8_fp4_paged_mqa_logits},
    )
    c = make_mqa_case(seed=8)
    width = max(e - s for s, e in zip(KS, KE, strict=True))
    got = funcs["fp8_fp4_mqa_logits"]((c.q, None), (c.k, c.k_scale), c.weights, c.ks, c.ke, width,
                                      logits_dtype=torch.float32)
    assert_logits_match(got, compressed(c.ref(), KS, KE, width))
    case = make_paged_case(**PAGED_CASES["next2-1d"], seed=9)  # type: ignore[arg-type]
    paged = funcs["fp8_fp4_paged_mqa_logits"]((case.q, None), case.cache(), case.weights, case.context_lens,
                                              case.block_tables, torch.zeros(2, 2, dtype=torch.int32),
                                              case.max_model_len, logits_dtype=torch.float32)
    assert_logits_match(paged, case.ref())


def test_mqa_check_catches_wrong_scale_and_mask() -> None:
    c = make_mqa_case(seed=2)
    ref = c.ref()
    unscaled = dg.fp8_fp4_mqa_logits((c.q, None), (c.k, torch.ones_like(c.k_scale)), c.weights, c.ks, c.ke, False)
    assert not logits_match(unscaled, ref), "a missing K scale went unnoticed"
    good = dg.fp8_fp4_mqa_logits((c.q, None), (c.k, c.k_scale), c.weights, c.ks, c.ke, False)
    assert logits_match(good, ref)
    past_end = good.clone()
    past_end[3, KE[3]] = 0.0  # one key past cu_seqlen_ke left finite
    assert not logits_match(past_end, ref), "an off-by-one mask went unnoticed"
    before_start = good.clone()
    before_start[3, KS[3] - 1] = 0.0
    assert not logits_match(before_start, ref)
    swapped_weights = dg.fp8_fp4_mqa_logits((c.q, None), (c.k, c.k_scale), c.weights.flip(1), c.ks, c.ke, False)
    assert not logits_match(swapped_weights, ref), "head weights applied to the wrong heads went unnoticed"


def test_mqa_logits_reject_fp4_and_non_fp8() -> None:
    c = make_mqa_case()
    with pytest.raises(NotImplementedError, match="FP4"):
        dg.fp8_fp4_mqa_logits((c.q, torch.ones(1)), (c.k, c.k_scale), c.weights, c.ks, c.ke, False)
    with pytest.raises(TypeError):
        dg.fp8_fp4_mqa_logits((c.q.float(), None), (c.k, c.k_scale), c.weights, c.ks, c.ke, False)


# ---------------------------------------------------------------- paged (decode) logits


@dataclass
class PagedCase:
    q: torch.Tensor  # [B, next_n, H, D] fp8
    weights: torch.Tensor  # [B * next_n, H]
    context_lens: torch.Tensor  # [B] or [B, next_n]
    row_lens: list[list[int]]  # effective length of every Q row, derived independently
    k_tokens: list[torch.Tensor]  # per request: [L_b, D] fp8, logical token order
    k_scales: list[torch.Tensor]  # per request: [L_b] fp32
    block_tables: torch.Tensor  # [B, W] int32
    num_blocks: int
    block_size: int
    max_model_len: int

    def ref(self) -> torch.Tensor:
        qf, wf = self.q.float().tolist(), self.weights.tolist()
        next_n = self.q.shape[1]
        rows = []
        for b, lens in enumerate(self.row_lens):
            kf, sf = self.k_tokens[b].float().tolist(), self.k_scales[b].tolist()
            for j, length in enumerate(lens):
                w = wf[b * next_n + j]
                rows.append(
                    [_score(qf[b][j], kf[t], sf[t], w) if t < length else NEG_INF for t in range(self.max_model_len)]
                )
        return torch.tensor(rows, dtype=torch.float64)

    def cache(self, page_pad: int = 0, interleaved: bool = False, device: str = "cpu") -> torch.Tensor:
        """The uint8 ``[num_blocks, block_size, 1, D + 4]`` cache, written byte by byte.

        Block layout (vLLM ``_fp8_quant_and_cache_write``): the fp8 value of token offset ``o`` at
        byte ``o * D``, its fp32 scale at byte ``block_size * D + 4 * o``. ``interleaved=True``
        writes the wrong, per-token ``[D values][4 scale bytes]`` layout instead. Unwritten bytes
        are 0x7F: a NaN fp8 value (and a huge scale), so reading a stale slot cannot go unnoticed.
        """
        d, bs = self.q.shape[3], self.block_size
        page = bs * (d + 4)
        buf = torch.full((self.num_blocks, page + page_pad), 0x7F, dtype=torch.uint8)
        table = self.block_tables.tolist()
        for b, (k, s) in enumerate(zip(self.k_tokens, self.k_scales, strict=True)):
            for t in range(k.shape[0]):
                blk, off = table[b][t // bs], t % bs
                value_bytes = k[t].view(torch.uint8)
                scale_bytes = s[t : t + 1].view(torch.uint8)
                if interleaved:
                    buf[blk, off * (d + 4) : off * (d + 4) + d] = value_bytes
                    buf[blk, off * (d + 4) + d : (off + 1) * (d + 4)] = scale_bytes
                else:
                    buf[blk, off * d : (off + 1) * d] = value_bytes
                    buf[blk, bs * d + 4 * off : bs * d + 4 * off + 4] = scale_bytes
        # vLLM allocates [num_blocks, block_size, D + 4] and passes kv_cache.unsqueeze(-2).
        return buf.to(device)[:, :page].view(self.num_blocks, bs, d + 4).unsqueeze(-2)

    def call(self, kv_cache: torch.Tensor, device: str = "cpu", **kwargs: object) -> torch.Tensor:
        return dg.fp8_fp4_paged_mqa_logits(
            (self.q.to(device), None),
            kv_cache,
            self.weights.to(device),
            self.context_lens.to(device),
            self.block_tables.to(device),
            torch.zeros(2, 2, dtype=torch.int32, device=device),
            max_model_len=self.max_model_len,
            clean_logits=False,
            **kwargs,
        )


def make_paged_case(
    *,
    next_n: int,
    context_lens: list[int] | list[list[int]],
    max_model_len: int,
    table_width: int,
    block_size: int = 4,
    garbage_entry: int = 0,
    seed: int = 0,
) -> PagedCase:
    """Requests with random K tokens on shuffled physical blocks.

    ``context_lens`` is 1-D (DeepGEMM's causal MTP form: row ``j`` of request ``b`` sees
    ``t <= context_lens[b] - next_n + j``) or 2-D ``[B][next_n]`` (row lengths given directly).
    Table entries past a request's blocks hold ``garbage_entry``.
    """
    gen = torch.Generator().manual_seed(seed)
    heads, dim = 3, 16
    batch = len(context_lens)
    if isinstance(context_lens[0], list):
        row_lens = [list(lens) for lens in context_lens]  # type: ignore[arg-type]
    else:
        row_lens = [
            [sum(1 for t in range(cl) if t <= cl - next_n + j) for j in range(next_n)]
            for cl in context_lens  # type: ignore[union-attr]
        ]
    lengths = [max(lens) for lens in row_lens]
    blocks_needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = []
    for need in blocks_needed:
        assert need <= table_width
        table.append(perm[:need] + [garbage_entry] * (table_width - need))
        perm = perm[need:]
    return PagedCase(
        q=_fp8((batch, next_n, heads, dim), gen),
        weights=torch.randn(batch * next_n, heads, generator=gen),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        row_lens=row_lens,
        k_tokens=[_fp8((n, dim), gen) for n in lengths],
        k_scales=[0.25 + 4 * torch.rand(n, generator=gen) for n in lengths],
        block_tables=torch.tensor(table, dtype=torch.int32).reshape(batch, table_width),
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
    )


PAGED_CASES = {
    # next_n = 1 with vLLM's [B, 1] context lens; an empty row; table span == max_model_len.
    "next1": dict(next_n=1, context_lens=[[5], [0], [12]], max_model_len=12, table_width=3),
    # MTP rows with 2-D lens; max_model_len not a block multiple; table wider than max_model_len.
    "next2-2d": dict(next_n=2, context_lens=[[6, 7], [1, 3], [9, 9]], max_model_len=10, table_width=4),
    # 1-D context lens (causal form); table span (12) shorter than max_model_len (14).
    "next2-1d": dict(next_n=2, context_lens=[7, 2, 9], max_model_len=14, table_width=3),
    # Stale out-of-range block ids past each request's blocks must not be read.
    "garbage-table": dict(
        next_n=2, context_lens=[[3, 4], [8, 8]], max_model_len=9, table_width=3, garbage_entry=10**6
    ),
}


@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_paged_logits_match_naive_formula(name: str) -> None:
    case = make_paged_case(**PAGED_CASES[name])  # type: ignore[arg-type]
    assert_logits_match(case.call(case.cache()), case.ref())


def test_paged_row_lengths_of_1d_context_lens() -> None:
    case = make_paged_case(**PAGED_CASES["next2-1d"])  # type: ignore[arg-type]
    assert case.row_lens == [[6, 7], [1, 2], [8, 9]]  # DeepGEMM: t <= context_len - next_n + j


def test_paged_logits_padded_pages_and_small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_paged_case(**PAGED_CASES["next2-2d"], seed=3)  # type: ignore[arg-type]
    ref = case.ref()
    padded = case.cache(page_pad=12)  # block stride larger than block_size * (D + 4)
    assert padded.stride(0) == case.block_size * 20 + 12
    assert_logits_match(case.call(padded), ref)
    monkeypatch.setattr(dg, "_ELEMENT_BUDGET", 1)  # one request per chunk
    assert_logits_match(case.call(padded), ref)


def test_paged_check_catches_wrong_layout_and_mask() -> None:
    case = make_paged_case(**PAGED_CASES["next2-2d"], seed=4)  # type: ignore[arg-type]
    ref = case.ref()
    assert not logits_match(case.call(case.cache(interleaved=True)), ref), "per-token interleaving went unnoticed"
    good = case.call(case.cache())
    assert logits_match(good, ref)
    past_end = good.clone()
    past_end[0, case.row_lens[0][0]] = 0.0  # row 0 one position too long
    assert not logits_match(past_end, ref)
    as_2d = make_paged_case(**PAGED_CASES["next2-1d"], seed=5)  # type: ignore[arg-type]
    as_2d.context_lens = as_2d.context_lens[:, None].expand(-1, 2).contiguous()  # every row sees context_len
    assert not logits_match(as_2d.call(as_2d.cache()), as_2d.ref()), "1-D vs 2-D context lens went unnoticed"
    wrong_scale = make_paged_case(**PAGED_CASES["next2-2d"], seed=4)  # type: ignore[arg-type]
    wrong_scale.k_scales = [s.flip(0) for s in wrong_scale.k_scales]  # scales of other tokens
    assert not logits_match(case.call(wrong_scale.cache()), ref), "misplaced K scales went unnoticed"


def test_paged_logits_reject_indices_fp4_and_bad_cache() -> None:
    case = make_paged_case(**PAGED_CASES["next1"])  # type: ignore[arg-type]
    cache = case.cache()
    with pytest.raises(NotImplementedError, match="indices"):
        case.call(cache, indices=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="FP4"):
        dg.fp8_fp4_paged_mqa_logits(
            (case.q, torch.ones(1)), cache, case.weights, case.context_lens, case.block_tables, None, 12, False
        )
    with pytest.raises(ValueError, match="D \\+ 4"):
        case.call(torch.zeros(case.num_blocks, 4, 1, 16, dtype=torch.uint8))
    with pytest.raises(TypeError):
        case.call(cache.view(FP8))


def test_logits_are_graph_safe_on_meta_tensors() -> None:
    """Meta tensors have no data: any host sync (.item(), .tolist()), torch.nonzero or boolean-mask
    indexing raises, so this proves both functions use static-shape ops only."""
    meta = "meta"
    b, n, h, d, bs = 4, 2, 8, 128, 64
    out = dg.fp8_fp4_paged_mqa_logits(
        (torch.empty(b, n, h, d, dtype=FP8, device=meta), None),
        torch.empty(50, bs, 1, d + 4, dtype=torch.uint8, device=meta),
        torch.empty(b * n, h, device=meta),
        torch.empty(b, n, dtype=torch.int32, device=meta),
        torch.empty(b, 9, dtype=torch.int32, device=meta),
        torch.empty(9, 2, dtype=torch.int32, device=meta),
        max_model_len=500,
        clean_logits=False,
    )
    assert out.shape == (b * n, 500) and out.dtype == torch.float32 and out.device.type == meta
    out = dg.fp8_fp4_mqa_logits(
        (torch.empty(33, h, d, dtype=FP8, device=meta), None),
        (torch.empty(70, d, dtype=FP8, device=meta), torch.empty(70, device=meta)),
        torch.empty(33, h, device=meta),
        torch.empty(33, dtype=torch.int32, device=meta),
        torch.empty(33, dtype=torch.int32, device=meta),
        clean_logits=False,
    )
    assert out.shape == (33, 70) and out.dtype == torch.float32
    with pytest.raises((RuntimeError, NotImplementedError)):  # the probe itself is sensitive
        torch.empty(3, device=meta).item()


# ---------------------------------------------------------------- metadata, SM count, surface


def test_metadata_shape_and_num_sms() -> None:
    ctx = torch.tensor([[5], [9]], dtype=torch.int32)
    meta = dg.get_paged_mqa_logits_metadata(ctx, 64, 132)
    assert meta.shape == (133, 2) and meta.dtype == torch.int32 and meta.device == ctx.device
    with pytest.raises(NotImplementedError, match="indices"):
        dg.get_paged_mqa_logits_metadata(ctx, 64, 132, indices=torch.zeros(2, dtype=torch.int32))
    default = dg.get_num_sms()
    assert default >= 1
    dg.set_num_sms(7)
    try:
        assert dg.get_num_sms() == 7
    finally:
        dg.set_num_sms(0)
    assert dg.get_num_sms() == default


def _names_resolved_by_vllm() -> set[str]:
    wrapper = pytest.importorskip("vllm.utils.deep_gemm")
    names = set(re.findall(r'getattr\(\s*_dg,\s*"(\w+)"', inspect.getsource(wrapper._lazy_init)))
    assert LOGITS_FUNCS <= names and "fp8_gemm_nt" in names, "vLLM's _lazy_init changed shape"
    return names


def test_standin_provides_only_the_indexer_kernels() -> None:
    provided = {name for name in _names_resolved_by_vllm() if hasattr(dg, name)}
    assert provided == LOGITS_FUNCS
    for name in ("set_pdl", "set_mk_alignment_for_contiguous_layout", "fp8_mqa_logits", "fp8_paged_mqa_logits"):
        assert not hasattr(dg, name), name
    assert set(dg.__all__) == {*LOGITS_FUNCS, "get_num_sms", "set_num_sms"}


# ---------------------------------------------------------------- through vLLM's wrapper


@pytest.fixture
def vllm_dg(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``vllm.utils.deep_gemm`` with ``tests/engine/standin`` first on ``sys.path`` and its caches reset."""
    wrapper = pytest.importorskip("vllm.utils.deep_gemm")
    import_utils = pytest.importorskip("vllm.utils.import_utils")

    def reset() -> None:
        for fn in (
            import_utils._has_module,
            wrapper._import_deep_gemm,
            wrapper.is_deep_gemm_supported,
            wrapper.is_deep_gemm_e8m0_used,
        ):
            clear = getattr(fn, "cache_clear", None)
            if clear is not None:
                clear()
        for name in list(vars(wrapper)):
            if name.startswith("_") and name.endswith("_impl"):
                setattr(wrapper, name, None)
        if "_oracle_cache" in vars(wrapper.DeepGemmQuantScaleFMT):
            delattr(wrapper.DeepGemmQuantScaleFMT, "_oracle_cache")

    monkeypatch.syspath_prepend(str(STANDIN))
    previous = sys.modules.pop("deep_gemm", None)
    reset()
    yield wrapper
    sys.modules.pop("deep_gemm", None)
    if previous is not None:
        sys.modules["deep_gemm"] = previous
    reset()


def test_vllm_wrapper_resolves_the_standin(vllm_dg: ModuleType) -> None:
    assert vllm_dg.has_deep_gemm()
    vllm_dg._lazy_init()
    module = vllm_dg._import_deep_gemm()
    assert Path(module.__file__).resolve() == STANDIN / "deep_gemm" / "__init__.py"
    assert vllm_dg._fp8_fp4_mqa_logits_impl is module.fp8_fp4_mqa_logits
    assert vllm_dg._fp8_fp4_paged_mqa_logits_impl is module.fp8_fp4_paged_mqa_logits
    assert vllm_dg._get_paged_mqa_logits_metadata_impl is module.get_paged_mqa_logits_metadata
    others = {
        name: value
        for name, value in vars(vllm_dg).items()
        if name.startswith("_") and name.endswith("_impl") and value is not None
    }
    assert set(others) == {
        "_fp8_fp4_mqa_logits_impl",
        "_fp8_fp4_paged_mqa_logits_impl",
        "_get_paged_mqa_logits_metadata_impl",
    }
    with pytest.raises(RuntimeError, match="DeepGEMM backend is unavailable"):
        vllm_dg.fp8_gemm_nt(None, None, None)
    vllm_dg.set_num_sms(5)
    try:
        assert vllm_dg.get_num_sms() == 5
    finally:
        vllm_dg.set_num_sms(0)


def test_vllm_wrapper_keeps_e8m0_off(vllm_dg: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend to be a DeepGEMM-capable GPU with E8M0 requested: only a GEMM impl could turn it on.
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", "1")
    monkeypatch.setattr(vllm_dg, "is_deep_gemm_supported", lambda: True)
    assert vllm_dg.is_deep_gemm_e8m0_used() is False
    assert vllm_dg._fp8_gemm_nt_impl is None
    assert vllm_dg.DeepGemmQuantScaleFMT.from_oracle() is vllm_dg.DeepGemmQuantScaleFMT.FLOAT32


def _taken(fn: Any, **kwargs: Any) -> dict[str, Any]:
    """Those of ``kwargs`` the installed release's wrapper takes: 0.28.0's ``clean_logits``; 0.34.0's
    ``max_seqlen_k`` (and ``logits_dtype``, left at its default)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def test_vllm_wrapper_mqa_logits(vllm_dg: ModuleType) -> None:
    """The installed release's wrapper over the stand-in: 0.28.0's full form (``clean_logits``), or the
    compressed form of the releases that pass ``max_seqlen_k`` (column j of row m is key ks[m] + j)."""
    c = make_mqa_case(seed=6)
    width = max(e - s for s, e in zip(KS, KE, strict=True))
    kwargs = _taken(vllm_dg.fp8_fp4_mqa_logits, clean_logits=False, max_seqlen_k=width)
    got = vllm_dg.fp8_fp4_mqa_logits((c.q, None), (c.k, c.k_scale), c.weights, c.ks, c.ke, **kwargs)
    assert_logits_match(got, compressed(c.ref(), KS, KE, width) if "max_seqlen_k" in kwargs else c.ref())


def test_vllm_wrapper_paged_logits_and_metadata(vllm_dg: ModuleType) -> None:
    case = make_paged_case(**PAGED_CASES["next2-2d"], seed=7)  # type: ignore[arg-type]
    num_sms = 8
    metadata = vllm_dg.get_paged_mqa_logits_metadata(case.context_lens, case.block_size, num_sms)
    assert metadata.dtype == torch.int32 and metadata.shape[1] == 2 and metadata.shape[0] <= num_sms + 1
    scheduler_metadata_buffer = torch.empty((num_sms + 1, 2), dtype=torch.int32)  # as the indexer builder does
    schedule = scheduler_metadata_buffer[: metadata.shape[0]]
    schedule[:] = metadata
    got = vllm_dg.fp8_fp4_paged_mqa_logits(
        (case.q, None),
        case.cache(),
        case.weights,
        case.context_lens,
        case.block_tables,
        schedule,
        max_model_len=case.max_model_len,
        indices=None,
        **_taken(vllm_dg.fp8_fp4_paged_mqa_logits, clean_logits=False),
    )
    assert_logits_match(got, case.ref())


# ---------------------------------------------------------------- GPU: CUDA-graph capture


@pytest.mark.gpu
def test_paged_logits_capture_in_cuda_graph() -> None:
    dev = "cuda"
    case = make_paged_case(**PAGED_CASES["next2-2d"], seed=8)  # type: ignore[arg-type]
    q = case.q.to(dev)
    kv_cache = case.cache(device=dev)
    weights = case.weights.to(dev)
    lens = case.context_lens.to(dev)
    table = case.block_tables.to(dev)
    schedule = dg.get_paged_mqa_logits_metadata(lens, case.block_size, 8)

    def run() -> torch.Tensor:
        return dg.fp8_fp4_paged_mqa_logits(
            (q, None), kv_cache, weights, lens, table, schedule, case.max_model_len, False
        )

    prefill_case = make_mqa_case(dev, seed=8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the stand-in raises
    try:
        eager = run()
        prefill = dg.fp8_fp4_mqa_logits(
            (prefill_case.q, None),
            (prefill_case.k, prefill_case.k_scale),
            prefill_case.weights,
            prefill_case.ks,
            prefill_case.ke,
            False,
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_logits_match(eager, case.ref())
    assert_logits_match(prefill, prefill_case.ref())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    lens.copy_(torch.tensor([[2, 3], [0, 1], [9, 4]], dtype=torch.int32, device=dev))  # new step, same buffers
    case.row_lens = lens.tolist()
    graph.replay()
    torch.cuda.synchronize()
    assert_logits_match(captured, case.ref())
