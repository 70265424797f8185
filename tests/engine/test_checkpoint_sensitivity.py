"""The generated checkpoint is scaled so that a wrong DCP merge moves logprobs far beyond rounding.

A plain-torch forward of the default checkpoint's first attention layer (MLA in its naive form,
the weights drawn exactly as ``generate`` draws them; rotary embedding left out, it does not
change the scales) straight into the final norm and LM head, for the last token of a 512-token
context: the logprobs with the exact attention, with the attention output rounded to bf16 (the
scale of the rounding a correct DCP merge adds), and with one DCP rank's interleaved half of the
context dropped (what the forced-MQA bug did to prefill rows) or its LSE ignored (a merge that
averages the ranks' partial outputs instead of weighting them).
"""

from __future__ import annotations

import torch

from overlay.engine.checkpoint import TinyGlm5Spec, draw, weight_recipes


def _w(name: str, recipes: dict) -> torch.Tensor:
    return draw(name, recipes[name], 0).float()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _logprobs_variants(n: int = 512) -> dict[str, torch.Tensor]:
    spec = TinyGlm5Spec()
    r = weight_recipes(spec)
    p = "model.layers.0.self_attn"
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (n,), generator=g)
    x = _w("model.embed_tokens.weight", r)[tokens]
    h = _rms(x, _w("model.layers.0.input_layernorm.weight", r))
    q = _rms(h @ _w(f"{p}.q_a_proj.weight", r).T, _w(f"{p}.q_a_layernorm.weight", r)) @ _w(f"{p}.q_b_proj.weight", r).T
    heads, nope, rope, v_dim = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    q = q.view(n, heads, nope + rope)
    kv_a = h @ _w(f"{p}.kv_a_proj_with_mqa.weight", r).T
    latent, k_rope = kv_a[:, : spec.kv_lora_rank], kv_a[:, spec.kv_lora_rank:]
    kv = (_rms(latent, _w(f"{p}.kv_a_layernorm.weight", r)) @ _w(f"{p}.kv_b_proj.weight", r).T).view(
        n, heads, nope + v_dim)
    k = torch.cat([kv[..., :nope], k_rope[:, None, :].expand(n, heads, rope)], dim=-1)
    v = kv[..., nope:]
    scores = torch.einsum("hd,nhd->hn", q[-1], k) / (nope + rope) ** 0.5  # the last token over all n

    def attend(mask: torch.Tensor) -> torch.Tensor:
        return torch.einsum("hn,nhd->hd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1), v)

    everything = torch.ones(n, dtype=torch.bool)
    even = torch.arange(n) % 2 == 0  # DCP 2 with interleave 1: rank 0 holds the even positions
    exact = attend(everything)
    # a merge that ignores the LSE: the plain mean of the two ranks' normalized partial outputs
    unweighted = (attend(even) + attend(~even)) / 2

    def logprobs(attn: torch.Tensor) -> torch.Tensor:
        out = x[-1] + attn.reshape(-1) @ _w(f"{p}.o_proj.weight", r).T
        logits = _rms(out, _w("model.norm.weight", r)) @ _w("lm_head.weight", r).T
        return torch.log_softmax(logits, -1)

    return {"exact": logprobs(exact), "bf16": logprobs(exact.bfloat16().float()),
            "half-dropped": logprobs(attend(even)), "lse-ignored": logprobs(unweighted)}


def test_a_wrong_merge_moves_logprobs_far_beyond_rounding() -> None:
    lp = _logprobs_variants()
    top = lp["exact"].argsort(descending=True)[:16]  # the tokens a greedy run and top-5 logprobs look at
    rounding = (lp["bf16"] - lp["exact"])[top].abs().max().item()
    moved = {w: (lp[w] - lp["exact"])[top].abs().max().item() for w in ("half-dropped", "lse-ignored")}
    # measured: rounding 0.0026, half dropped 1.01, LSE ignored 0.079 nats
    assert rounding < 0.0625  # the check's floor
    assert moved["half-dropped"] > 100 * rounding and moved["half-dropped"] > 0.5
    assert moved["lse-ignored"] > 20 * rounding  # milder (both halves hold similar mass), still far beyond
