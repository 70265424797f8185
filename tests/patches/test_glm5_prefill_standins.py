"""The dense-MHA prefill's stand-ins (``glm5_prefill_standins``) hold to the contracts of what they replace.

``test_glm5_steps.py`` compares DCP 2 and 4 with DCP 1 through these stand-ins, and DCP 1 with float64
attention: a stand-in that got FlashAttention's or the merge kernel's contract wrong in a way every DCP size
shares (an LSE in the wrong base or layout, a causal mask aligned the wrong way, an infinite LSE read as a
weight) could pass there. Here each is held to its contract directly, in float64 from first principles, and,
where the release carries a torch implementation of its own (0.34.0: ``CPUSDPAMLAPrefillBackend``,
``_merge_attn_states_torch``), to that too. Runs on the installed release and, through
``tests/test_patches_against_base.py``, on every other carried release in its environment.
"""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace

import glm5_prefill_standins as ps
import pytest
import torch

HEADS, QK, V = 3, 24, 16


def _attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[tuple[int, int]], scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row: query ``i`` of a request's ``Lq`` sees key ``j`` of its ``Lk`` iff unmasked or
    ``j <= i + Lk - Lq``; a row that sees none: output 0 and LSE ``+inf`` (FlashAttention's)."""
    out = torch.zeros(q.shape[0], HEADS, v.shape[-1], dtype=torch.float64)
    lse = torch.empty(HEADS, q.shape[0], dtype=torch.float64)
    q0 = k0 = 0
    for len_q, len_k in lens:
        for i in range(len_q):
            keys = [j for j in range(len_k) if not causal or j <= i + len_k - len_q]
            for h in range(HEADS):
                if not keys:
                    lse[h, q0 + i] = math.inf
                    continue
                s = [float(q[q0 + i, h].double() @ k[k0 + j, h].double()) * scale for j in keys]
                top = max(s)
                w = [math.exp(x - top) for x in s]
                lse[h, q0 + i] = top + math.log(sum(w))
                out[q0 + i, h] = sum(wj * v[k0 + j, h].double() for wj, j in zip(w, keys, strict=True)) / sum(w)
        q0, k0 = q0 + len_q, k0 + len_k
    return out, lse


def _qkv(lens: list[tuple[int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
    return tuple(torch.randn(n, HEADS, d, generator=gen).to(torch.bfloat16)
                 for n, d in ((tq, QK), (tk, QK), (tk, V)))


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_varlen_is_attention(causal: bool) -> None:
    """Per request, causal bottom-right aligned (fewer queries than keys: the queries are the last ones) or
    unmasked; output in q's dtype ``[Tq, H, V]``, LSE ``[H, Tq]`` float32 in natural log; a request with no
    key (and, causal, a query above the diagonal) gets output 0 and LSE ``+inf``."""
    lens = [(5, 5), (3, 7), (4, 0), (2, 3)] if causal else [(5, 9), (4, 0), (3, 2)]
    q, k, v = _qkv(lens, 11)
    if causal:  # a request of more queries than keys: its first queries see nothing
        lens.append((4, 2))
        q2, k2, v2 = _qkv([(4, 2)], 12)
        q, k, v = torch.cat([q, q2]), torch.cat([k, k2]), torch.cat([v, v2])
    scale = QK ** -0.5
    out, lse = ps.flash_attn_varlen(q, k, v, _cu([a for a, _ in lens]), _cu([b for _, b in lens]),
                                    max(a for a, _ in lens), max(b for _, b in lens), scale, causal)
    ref_out, ref_lse = _attention_f64(q, k, v, lens, scale, causal)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (q.shape[0], HEADS, V)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (HEADS, q.shape[0])
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and bool((lse[torch.isinf(lse)] > 0).all())
    assert torch.isinf(lse).any(), "the case has rows with no key"
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-4)
    assert torch.allclose(out.double(), ref_out, atol=2e-2)
    assert not out[torch.isinf(lse).T].any(), "a row with no key is 0"


def test_flash_attn_varlen_writes_out_and_refuses_what_it_would_skip() -> None:
    """``out=`` is written in place and returned; a request longer than ``max_seqlen_*`` (the kernel's grid
    would skip its tail), an ``out`` of another shape and int64 boundaries are refused."""
    lens = [(4, 4), (3, 3)]
    q, k, v = _qkv(lens, 3)
    cu = _cu([4, 3])
    out = torch.full((7, HEADS, V), float("nan"), dtype=torch.bfloat16)
    got, _ = ps.flash_attn_varlen(q, k, v, cu, cu, 4, 4, 0.2, True, out=out)
    assert got is out and torch.isfinite(out).all()
    ref, _ = ps.flash_attn_varlen(q, k, v, cu, cu, 4, 4, 0.2, True)
    assert torch.equal(out, ref)
    for bad in (dict(max_seqlen_q=3), dict(out=torch.empty(7, HEADS, QK, dtype=torch.bfloat16)),
                dict(cu_seqlens_q=cu.long(), cu_seqlens_k=cu.long())):
        kwargs = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4,
                      softmax_scale=0.2, causal=True) | bad
        with pytest.raises(RuntimeError):
            ps.flash_attn_varlen(**kwargs)


def _backend(cls: type) -> object:
    return cls(num_heads=HEADS, scale=QK ** -0.5, kv_lora_rank=64, qk_nope_head_dim=QK - 8, qk_rope_head_dim=8,
               v_head_dim=V, vllm_config=None)


def _chunk(lens: list[tuple[int, int]]) -> SimpleNamespace:
    return SimpleNamespace(query_start_loc=_cu([a for a, _ in lens]), cu_seq_lens=_cu([b for _, b in lens]),
                           max_query_len=max(a for a, _ in lens), max_seq_len=max(b for _, b in lens),
                           seq_lens=torch.tensor([b for _, b in lens], dtype=torch.int32))


def test_the_varlen_backend_is_flash_attention_as_the_layer_calls_it() -> None:
    """Our ``FLASH_ATTN`` (the release's ``MLAPrefillBackend`` subclass): the new tokens causal per request,
    the output alone unless the LSE is asked for; a context chunk unmasked with its LSE; ``out`` honoured
    (FA3 takes V unpadded); no fp8 output. Where the release has its own CPU prefill backend, the two agree."""
    backend = _backend(ps.flash_attn_varlen_prefill_backend())
    assert backend.get_name() == "FLASH_ATTN" and backend.supports_out()
    assert not backend.supports_quant_output(None)
    new = [(5, 5), (3, 3)]
    q, k, v = _qkv(new, 5)
    backend.prepare_metadata(SimpleNamespace(query_start_loc=_cu([5, 3]), max_query_len=5))
    alone = backend.run_prefill_new_tokens(q, k, v, return_softmax_lse=False)
    out, lse = backend.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
    ref_out, ref_lse = _attention_f64(q, k, v, new, QK ** -0.5, True)
    assert torch.equal(alone, out) and torch.allclose(out.double(), ref_out, atol=2e-2)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4)
    with pytest.raises(RuntimeError, match="fp8"):
        backend.run_prefill_new_tokens(q, k, v, return_softmax_lse=False, output_scale=torch.ones(()))
    context = [(5, 9), (3, 2)]
    _, kc, vc = _qkv(context, 6)
    c_out, c_lse = backend.run_prefill_context_chunk(_chunk(context), q, kc, vc)
    ref_out, ref_lse = _attention_f64(q, kc, vc, context, QK ** -0.5, False)
    assert torch.allclose(c_out.double(), ref_out, atol=2e-2) and torch.allclose(c_lse.double(), ref_lse, atol=1e-4)
    written = torch.empty_like(c_out)
    assert backend.run_prefill_context_chunk(_chunk(context), q, kc, vc, out=written)[0] is written
    try:
        from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
    except ImportError:
        return
    theirs = _backend(CPUSDPAMLAPrefillBackend)
    theirs.prepare_metadata(SimpleNamespace(query_start_loc=_cu([5, 3]), max_query_len=5,
                                            query_lens_cpu=torch.tensor([5, 3])))
    t_out, t_lse = theirs.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
    assert torch.allclose(t_out.double(), out.double(), atol=2e-2) and torch.allclose(t_lse, lse, atol=1e-3)
    t_out, t_lse = theirs.run_prefill_context_chunk(_chunk(context), q, kc, vc)
    assert torch.allclose(t_out.double(), c_out.double(), atol=2e-2) and torch.allclose(t_lse, c_lse, atol=1e-3)


def _merge_f64(p_out, p_lse, s_out, s_lse, with_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA kernel's arithmetic, token by token and head by head."""
    tokens, heads, _ = p_out.shape
    out = torch.empty(p_out.shape, dtype=torch.float64)
    lse = torch.empty(heads, tokens, dtype=torch.float64)
    for t in range(tokens):
        for h in range(heads):
            if t >= with_context:
                out[t, h], lse[h, t] = s_out[t, h].double(), float(s_lse[h, t])
                continue
            p, s = (-math.inf if math.isinf(x) else x for x in (float(p_lse[h, t]), float(s_lse[h, t])))
            top = max(p, s)
            if math.isinf(top):
                out[t, h], lse[h, t] = p_out[t, h].double(), top
                continue
            wp, ws = math.exp(p - top), math.exp(s - top)
            out[t, h] = (p_out[t, h].double() * wp + s_out[t, h].double() * ws) / (wp + ws)
            lse[h, t] = math.log(wp + ws) + top
    return out, lse


def _merge_inputs(tokens: int, padded: int) -> tuple[torch.Tensor, ...]:
    """Prefix and suffix ``[T, H, V]`` views of ``[T, H, padded]`` tensors (the layer slices a padded
    partial), LSEs ``[H, T]`` about 543 (as long contexts make them) with infinities of both signs."""
    gen = torch.Generator().manual_seed(tokens)
    p_out = torch.randn(tokens, HEADS, padded, generator=gen).to(torch.bfloat16)[..., :V]
    s_out = torch.randn(tokens, HEADS, padded, generator=gen).to(torch.bfloat16)[..., :V]
    p_lse = 543 + torch.randn(HEADS, tokens, generator=gen)
    s_lse = 543 + torch.randn(HEADS, tokens, generator=gen)
    p_lse[0, 1] = math.inf  # FlashAttention's empty row: no weight
    s_lse[1, 2] = -math.inf
    p_lse[2, 3], s_lse[2, 3] = math.inf, -math.inf  # both empty: the prefix, LSE -inf
    p_lse[0, tokens - 1] = math.nan  # past the merged tokens: never read
    s_lse[1, tokens - 1] = math.inf  # and copied as it is
    return p_out, p_lse, s_out, s_lse


@pytest.mark.parametrize("padded", [V, V + 8])
def test_the_merge_kernel_standin_computes_the_cuda_kernel(padded: int) -> None:
    """``merge_attn_states_kernel`` is the CUDA kernel's arithmetic (``_merge_f64``), read at the prefix's head
    stride, with the suffix copied past ``prefill_tokens_with_context``; the output LSE too. Where the
    release has its own torch merge, the two agree but where both LSEs are empty (the kernel copies the
    prefix there, 0.34.0's torch merge writes 0)."""
    tokens = 6
    p_out, p_lse, s_out, s_lse = _merge_inputs(tokens, padded)
    out = torch.full((tokens, HEADS, V), float("nan"), dtype=torch.bfloat16)
    out_lse = torch.full((HEADS, tokens), float("nan"))
    ps.merge_attn_states_kernel(out, p_out, p_lse, s_out, s_lse, out_lse, tokens - 1)
    ref, ref_lse = _merge_f64(p_out, p_lse, s_out, s_lse, tokens - 1)
    assert torch.allclose(out.double(), ref, atol=2e-2)
    assert torch.equal(torch.isinf(out_lse), torch.isinf(ref_lse))
    assert out_lse[2, 3] == -math.inf and out_lse[1, tokens - 1] == math.inf
    assert torch.equal(out[3, 2], p_out[3, 2])
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(out_lse[finite].double(), ref_lse[finite], atol=1e-4)
    everything = torch.empty_like(out)
    ps.merge_attn_states_kernel(everything, p_out, p_lse.nan_to_num(nan=0.0), s_out, s_lse)  # default: all merge
    ref, _ = _merge_f64(p_out, p_lse.nan_to_num(nan=0.0), s_out, s_lse, tokens)
    assert torch.allclose(everything.double(), ref, atol=2e-2)
    mas = importlib.import_module("vllm.v1.attention.ops.merge_attn_states")
    theirs = getattr(mas, "_merge_attn_states_torch", None)
    if theirs is None:
        return
    other = torch.empty_like(out)
    theirs(other, p_out, p_lse, s_out, s_lse, None, tokens - 1)
    agree = torch.ones(tokens, HEADS, 1, dtype=torch.bool)
    agree[3, 2] = False
    assert torch.allclose(torch.where(agree, other, out).double(), out.double(), atol=1e-2)


def test_the_merge_kernel_standin_writes_fp8_and_refuses_what_the_op_refuses() -> None:
    """With ``output_scale`` the merged values divided by the scale, saturated, in fp8; the op's host checks
    (``MERGE_CHECKS``) as the op makes them."""
    p_out, p_lse, s_out, s_lse = _merge_inputs(6, V)
    wide = torch.empty(6, HEADS, V, dtype=torch.bfloat16)
    ps.merge_attn_states_kernel(wide, p_out, p_lse, s_out, s_lse, None, 5)
    fp8 = torch.empty(6, HEADS, V, dtype=torch.float8_e4m3fn)
    ps.merge_attn_states_kernel(fp8, p_out, p_lse, s_out, s_lse, None, 5, torch.tensor(0.004))
    limit = torch.finfo(torch.float8_e4m3fn).max
    assert torch.allclose(fp8.float(), (wide.float() / 0.004).clamp(-limit, limit).to(fp8.dtype).float(), rtol=0.13,
                          atol=0.01)
    assert (fp8.float().abs() == limit).any(), "some value saturates"
    cases = [
        (dict(output=wide, output_scale=torch.tensor(1.0)), 0),
        (dict(output=wide.float()), 1),
        (dict(output=wide.to(torch.float8_e4m3fn), prefix_output=p_out.to(torch.float8_e4m3fn),
              output_scale=torch.tensor(1.0)), 2),
        (dict(output=wide[..., :12], prefix_output=p_out[..., :12], suffix_output=s_out[..., :12]), 3),
        (dict(output=wide, prefill_tokens_with_context=7), 4),
    ]
    for change, check in cases:
        args = dict(output=wide, prefix_output=p_out, prefix_lse=p_lse, suffix_output=s_out, suffix_lse=s_lse) | change
        with pytest.raises(RuntimeError, match=ps.MERGE_CHECKS[check].split(":")[0]):
            ps.merge_attn_states_kernel(**args)


def test_the_merge_dispatches_to_the_standin_as_on_cuda() -> None:
    """After ``install``, the release's ``merge_attn_states`` takes its CUDA branch to the op's stand-in: the
    release's own torch merge where it has one, else ours."""
    from vllm import _custom_ops as ops

    mas = importlib.import_module("vllm.v1.attention.ops.merge_attn_states")
    saved = ops.merge_attn_states, mas.current_platform
    try:
        ps.install(None)
        assert isinstance(mas.current_platform, ps.CudaDispatch)
        assert ops.merge_attn_states is getattr(mas, "_merge_attn_states_torch", ps.merge_attn_states_kernel)
        p_out, p_lse, s_out, s_lse = _merge_inputs(6, V)
        out = torch.empty(6, HEADS, V, dtype=torch.bfloat16)
        mas.merge_attn_states(out, p_out, p_lse.nan_to_num(nan=0.0), s_out, s_lse)
        ref, _ = _merge_f64(p_out, p_lse.nan_to_num(nan=0.0), s_out, s_lse, 6)
        agree = torch.ones(6, HEADS, 1, dtype=torch.bool)
        agree[3, 2] = False  # both empty: see above
        assert torch.allclose(torch.where(agree, out.double(), ref), ref, atol=2e-2)
    finally:
        ops.merge_attn_states, mas.current_platform = saved


def test_the_direct_kv_gather_checks_are_the_ops() -> None:
    """The direct KV gather's stand-in checks what the op checks: a well-formed call passes, each break of its
    layout is refused with the op's message."""
    tokens, dim, world, cap = 4, 576, 2, 8

    def call(**change):
        args = dict(local_kv=torch.zeros(tokens, dim, dtype=torch.bfloat16),
                    received_kv=torch.zeros(2, cap, dim, dtype=torch.bfloat16),
                    received_signal=torch.zeros(2, world, dtype=torch.int32),
                    completion=torch.zeros(2, dtype=torch.int32), epoch=torch.zeros(1, dtype=torch.int64),
                    gathered_kv=torch.zeros(tokens * world, dim, dtype=torch.bfloat16), world_size=world, rank=1,
                    max_gathered_tokens=cap, kv_mc_ptr=1, signal_mc_ptr=1) | change
        ps.direct_dcp_kv_gather_checks(**args)

    call()
    for change, message in [
        (dict(local_kv=torch.zeros(tokens, dim)), "only supports FP16, BF16, and FP8"),
        (dict(local_kv=torch.zeros(dim, tokens, dtype=torch.bfloat16).T), "contiguous"),
        (dict(rank=2), "invalid rank"),
        (dict(max_gathered_tokens=6), "exceeds"),
        (dict(gathered_kv=torch.zeros(tokens, dim, dtype=torch.bfloat16)), r"\[world_size\*T,D\]"),
        (dict(kv_mc_ptr=0), "multicast"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            call(**change)
