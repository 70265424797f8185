"""Generate a small GLM-5-architecture checkpoint, deterministically, for engine-level checks.

The checkpoint is what ``vllm serve`` / ``vllm.LLM`` load for ``GlmMoeDsaForCausalLM``
(``model_type: glm_moe_dsa``): GLM-5's attention dimensions (MLA with kv_lora_rank 512,
qk_nope 192, qk_rope 64, v_head 256; the DSA indexer with 32 heads of 128 and top-k 2048),
a few layers (the first dense, the rest a small MoE with a shared expert and sigmoid
``noaux_tc`` routing) and one MTP layer, so every sparse-MLA and DCP path of the engine runs
with production's shapes at a fraction of the size. The weights are seeded random numbers in
safetensors; each tensor is drawn from its own generator seeded by the checkpoint seed and the
tensor's name, so the files are byte-identical for the same spec and seed on any machine.

Scaling: the weights are not a trained model, so they are scaled to make the attention
*matter*: the query projection is amplified (``q_gain``) so the softmax over thousands of
tokens is peaked on a few of them, and the attention output enters the residual stream at unit
scale. A wrong DCP merge (a rank's partial dropped, rows masked, the wrong LSE) then changes
which tokens dominate a head's output and moves next-token logprobs by O(1) nats, far beyond
bf16/fp8 rounding (``engine.check`` measures both). Every token goes to every expert
(``num_experts_per_tok = n_routed_experts``): the MoE kernels, the sigmoid ``noaux_tc`` gate and
the weights still run as in GLM-5, but no hard top-k choice of experts remains. With a top-2 of
8 (the first version), rounding noise flipped near-tied expert choices and two DCP 1 runs that
differed only in batch composition disagreed by up to 1 nat on 16-token prompts (two H200s,
2026-11-30), which drowned the comparison; the indexer's top-k beyond ``index_topk`` is the one
hard selection left, as in production. The tokenizer is byte-level (one token per
byte, no merges) with the rest of the vocabulary reserved special tokens, so ``vllm serve``
takes text and any prompt length is exact in tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from overlay import digest
from overlay.atomic import replacing_dir
from overlay.build.fetch import sha256_file
from overlay.errors import OverlayError
from overlay.outpaths import check_dir

EOS_TOKEN = "<|endoftext|>"
FORMAT_VERSION = 1  # bump when the file layout or the drawing rule changes


@dataclass(frozen=True)
class TinyGlm5Spec:
    """The shape of the generated checkpoint. Defaults: GLM-5 attention, 8 heads per rank at TP2."""

    tp: int = 2
    heads_per_rank: int = 8
    hidden_size: int = 1024
    num_hidden_layers: int = 3
    first_k_dense_replace: int = 1
    intermediate_size: int = 2048
    moe_intermediate_size: int = 256
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8  # every expert: routing without a hard choice (see the docstring)
    num_nextn_predict_layers: int = 1
    vocab_size: int = 512
    q_lora_rank: int = 768
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    max_position_embeddings: int = 65536
    q_gain: float = 2.0
    lm_head_gain: float = 2.5

    @property
    def num_heads(self) -> int:
        return self.tp * self.heads_per_rank

    def validate(self) -> None:
        """Reject specs the engine cannot load, naming the field."""
        positive = ("tp", "heads_per_rank", "hidden_size", "num_hidden_layers", "intermediate_size",
                    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "vocab_size",
                    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "index_topk", "index_head_dim", "index_n_heads", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) <= 0:
                raise OverlayError(f"checkpoint spec: {name} must be > 0, got {getattr(self, name)}")
        if self.vocab_size < 257:
            raise OverlayError(f"checkpoint spec: vocab_size must be >= 257 (256 bytes + EOS), got {self.vocab_size}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise OverlayError("checkpoint spec: first_k_dense_replace must be in [0, num_hidden_layers]")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise OverlayError("checkpoint spec: num_experts_per_tok must be <= n_routed_experts")
        if self.num_nextn_predict_layers < 0:
            raise OverlayError("checkpoint spec: num_nextn_predict_layers must be >= 0")


def config_dict(spec: TinyGlm5Spec) -> dict[str, Any]:
    """The ``config.json`` of the checkpoint (GLM-5's fields, small sizes)."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 256,
        "eos_token_id": 256,
        "pad_token_id": 256,
        "first_k_dense_replace": spec.first_k_dense_replace,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "index_head_dim": spec.index_head_dim,
        "index_n_heads": spec.index_n_heads,
        "index_topk": spec.index_topk,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "kv_lora_rank": spec.kv_lora_rank,
        "max_position_embeddings": spec.max_position_embeddings,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "n_group": 1,
        "n_routed_experts": spec.n_routed_experts,
        "n_shared_experts": spec.n_shared_experts,
        "norm_topk_prob": True,
        "num_attention_heads": spec.num_heads,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_heads,
        "num_nextn_predict_layers": spec.num_nextn_predict_layers,
        "q_lora_rank": spec.q_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": spec.v_head_dim,
        "vocab_size": spec.vocab_size,
    }


# A tensor's recipe: shape, standard deviation (0: constant `fill`), fill, dtype name.
Recipe = tuple[tuple[int, ...], float, float, str]


def _linear(out_f: int, in_f: int, gain: float = 1.0) -> Recipe:
    return (out_f, in_f), gain / in_f**0.5, 0.0, "bfloat16"


def _ones(n: int) -> Recipe:
    return (n,), 0.0, 1.0, "bfloat16"


def _layer(spec: TinyGlm5Spec, prefix: str, dense: bool) -> dict[str, Recipe]:
    h, heads = spec.hidden_size, spec.num_heads
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    a = f"{prefix}.self_attn"
    out: dict[str, Recipe] = {
        f"{prefix}.input_layernorm.weight": _ones(h),
        f"{prefix}.post_attention_layernorm.weight": _ones(h),
        f"{a}.q_a_proj.weight": _linear(spec.q_lora_rank, h),
        f"{a}.q_a_layernorm.weight": _ones(spec.q_lora_rank),
        f"{a}.q_b_proj.weight": _linear(heads * qk, spec.q_lora_rank, spec.q_gain),
        f"{a}.kv_a_proj_with_mqa.weight": _linear(spec.kv_lora_rank + spec.qk_rope_head_dim, h),
        f"{a}.kv_a_layernorm.weight": _ones(spec.kv_lora_rank),
        f"{a}.kv_b_proj.weight": _linear(heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
        f"{a}.o_proj.weight": _linear(h, heads * spec.v_head_dim),
        f"{a}.indexer.wq_b.weight": _linear(spec.index_n_heads * spec.index_head_dim, spec.q_lora_rank),
        f"{a}.indexer.wk.weight": _linear(spec.index_head_dim, h),
        f"{a}.indexer.weights_proj.weight": _linear(spec.index_n_heads, h),
        f"{a}.indexer.k_norm.weight": _ones(spec.index_head_dim),
        f"{a}.indexer.k_norm.bias": ((spec.index_head_dim,), 0.0, 0.0, "bfloat16"),
    }
    m = f"{prefix}.mlp"
    if dense:
        i = spec.intermediate_size
        out |= {f"{m}.gate_proj.weight": _linear(i, h), f"{m}.up_proj.weight": _linear(i, h),
                f"{m}.down_proj.weight": _linear(h, i, 0.5)}
        return out
    i = spec.moe_intermediate_size
    out |= {f"{m}.gate.weight": _linear(spec.n_routed_experts, h),
            f"{m}.gate.e_score_correction_bias": ((spec.n_routed_experts,), 0.0, 0.0, "float32")}
    for e in range(spec.n_routed_experts):
        out |= {f"{m}.experts.{e}.gate_proj.weight": _linear(i, h), f"{m}.experts.{e}.up_proj.weight": _linear(i, h),
                f"{m}.experts.{e}.down_proj.weight": _linear(h, i, 0.5)}
    if spec.n_shared_experts:
        s = i * spec.n_shared_experts
        out |= {f"{m}.shared_experts.gate_proj.weight": _linear(s, h),
                f"{m}.shared_experts.up_proj.weight": _linear(s, h),
                f"{m}.shared_experts.down_proj.weight": _linear(h, s, 0.5)}
    return out


def weight_recipes(spec: TinyGlm5Spec) -> dict[str, Recipe]:
    """Every tensor of the checkpoint under its Hugging Face name, with how it is drawn."""
    h, v = spec.hidden_size, spec.vocab_size
    out: dict[str, Recipe] = {
        "model.embed_tokens.weight": ((v, h), 1.0, 0.0, "bfloat16"),
        "model.norm.weight": _ones(h),
        "lm_head.weight": _linear(v, h, spec.lm_head_gain),
    }
    for layer in range(spec.num_hidden_layers):
        out |= _layer(spec, f"model.layers.{layer}", dense=layer < spec.first_k_dense_replace)
    for k in range(spec.num_nextn_predict_layers):
        p = f"model.layers.{spec.num_hidden_layers + k}"
        out |= _layer(spec, p, dense=False)
        out |= {
            f"{p}.embed_tokens.weight": out["model.embed_tokens.weight"],
            f"{p}.enorm.weight": _ones(h),
            f"{p}.hnorm.weight": _ones(h),
            f"{p}.eh_proj.weight": _linear(h, 2 * h),
            f"{p}.shared_head.norm.weight": _ones(h),
            f"{p}.shared_head.head.weight": out["lm_head.weight"],
        }
    return out


def _tensor_seed(seed: int, name: str) -> int:
    raw = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(raw[:8], "little") & ((1 << 63) - 1)


def shared_weights(spec: TinyGlm5Spec) -> dict[str, str]:
    """The MTP layers' copies of the embedding and the LM head: copy name -> original name."""
    out: dict[str, str] = {}
    for k in range(spec.num_nextn_predict_layers):
        p = f"model.layers.{spec.num_hidden_layers + k}"
        out |= {f"{p}.embed_tokens.weight": "model.embed_tokens.weight",
                f"{p}.shared_head.head.weight": "lm_head.weight"}
    return out


def draw(name: str, recipe: Recipe, seed: int):
    """The tensor ``name``, drawn from its own CPU generator (independent of every other tensor)."""
    import torch

    shape, std, fill, dtype = recipe
    if std == 0.0:
        t = torch.full(shape, fill, dtype=torch.float32)
    else:
        g = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
        t = torch.randn(shape, generator=g, dtype=torch.float32) * std
    return t.to(getattr(torch, dtype)).contiguous()


def _byte_table() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_files(spec: TinyGlm5Spec) -> dict[str, str]:
    """``tokenizer.json`` (byte-level, one token per byte) and ``tokenizer_config.json``, as text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = _byte_table()
    vocab = {table[b]: b for b in range(256)}  # token id == byte value
    if set(vocab) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise OverlayError("tokenizers' ByteLevel alphabet is not the GPT-2 byte table")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = [EOS_TOKEN] + [f"<|reserved_{i}|>" for i in range(spec.vocab_size - 257)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}",
    }
    return {"tokenizer.json": tok.to_str(pretty=True) + "\n",
            "tokenizer_config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"}


def checkpoint_id(spec: TinyGlm5Spec, seed: int) -> str:
    """A short name for (format, spec, seed): the cache folder's name."""
    blob = json.dumps({"format": FORMAT_VERSION, "spec": asdict(spec), "seed": seed}, sort_keys=True)
    return "tiny-glm5-" + digest.of_text(blob)[:12]


def default_cache() -> Path:
    """``checkpoints/`` under the tool's one cache root (``fetch.cache_dir``: never inside the repository)."""
    from overlay.build.fetch import cache_dir

    return cache_dir() / "checkpoints"


def write_config_and_tokenizer(folder: Path, spec: TinyGlm5Spec) -> None:
    """``config.json`` and the byte-level tokenizer files of ``spec`` into ``folder``."""
    (folder / "config.json").write_text(json.dumps(config_dict(spec), indent=2, sort_keys=True) + "\n")
    for fname, text in tokenizer_files(spec).items():
        (folder / fname).write_text(text)


def damage(out: Path, manifest: dict[str, Any], *, digests: bool = False) -> list[str]:
    """What is wrong with the files ``manifest`` records in ``out``: missing, another size, or (``digests``,
    or no sizes recorded) another sha256. Empty when the folder is as it was written."""
    files, sizes = manifest.get("files") or {}, manifest.get("sizes") or {}
    if not isinstance(files, dict) or not files:
        return ["checkpoint.json records no files"]
    problems = []
    for name, sha in sorted(files.items()):
        path = out / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif name in sizes and path.stat().st_size != sizes[name]:
            problems.append(f"{name} is {path.stat().st_size} bytes, {sizes[name]} written")
        elif (digests or name not in sizes) and sha256_file(path) != sha:
            problems.append(f"{name}'s sha256 is not the one written")
    return problems


def generate(out: Path, spec: TinyGlm5Spec | None = None, seed: int = 0, *, force: bool = False,
             verify: bool = False) -> Path:
    """Write the checkpoint into ``out`` (atomically: a temporary sibling renamed into place).

    An existing ``out`` whose ``checkpoint.json`` records the same id is kept if its files are as
    written (sizes; sha256 too with ``verify``), else generated again, said on stderr. Returns ``out``.
    """
    import sys

    from safetensors.torch import save_file

    check_dir(out, "checkpoint folder")
    spec = spec or TinyGlm5Spec()
    spec.validate()
    cid = checkpoint_id(spec, seed)
    manifest = out / "checkpoint.json"
    if out.exists() and not force:
        try:
            doc = json.loads(manifest.read_text())
            ours = doc["id"] == cid
        except (OSError, ValueError, KeyError, TypeError):
            ours = False
        if not ours:
            raise OverlayError(f"{out}: exists and is not checkpoint {cid}; remove it or pass --force")
        problems = damage(out, doc, digests=verify)
        if not problems:
            return out
        print(f"checkpoint {out}: {'; '.join(problems)}: generating it again", file=sys.stderr, flush=True)
    with replacing_dir(out) as tmp:
        recipes = weight_recipes(spec)
        copies = shared_weights(spec)
        tensors = {name: draw(name, recipes[name], seed) for name in sorted(recipes) if name not in copies}
        tensors |= {name: tensors[original].clone() for name, original in copies.items()}  # no shared storage
        tensors = dict(sorted(tensors.items()))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)
        write_config_and_tokenizer(tmp, spec)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}
        sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        params = sum(t.numel() for t in tensors.values())
        manifest_doc = {"id": cid, "format": FORMAT_VERSION, "seed": seed, "spec": asdict(spec),
                        "parameters": params, "files": files, "sizes": sizes}
        (tmp / "checkpoint.json").write_text(json.dumps(manifest_doc, indent=2, sort_keys=True) + "\n")
    return out


# GLM-5's published shape (the GlmMoeDsa config): 78 layers (3 dense), hidden 6144, 64 heads,
# 8 of 256 routed experts + 1 shared of 2048 a token, dense FFN 12288, vocab 154880.
GLM5_LAYERS, GLM5_DENSE, GLM5_HIDDEN, GLM5_HEADS = 78, 3, 6144, 64
GLM5_ACTIVE_EXPERT_FFN = (8 + 1) * 2048  # routed + shared intermediate rows a token passes through
GLM5_DENSE_FFN, GLM5_VOCAB = 12288, 154880
NVFP4_BYTES = 0.5625  # bytes per weight of NVFP4: 4 bits + one FP8 scale per 16


def glm5_per_rank(tp: int, production_tp: int = 8, weight_bytes: float = NVFP4_BYTES) -> TinyGlm5Spec:
    """GLM-5 as one rank of ``production_tp`` sees it, for a ``tp``-GPU timing run with dummy weights.

    GLM-5's attention dimensions and depth, ``64 / production_tp`` heads per rank. The FFNs are
    sized so that the weight bytes a token reads per rank match production's: production reads
    ``GLM5_ACTIVE_EXPERT_FFN / production_tp`` expert rows of ``weight_bytes`` each (NVFP4 by
    default), the dummy bf16 model (2 bytes) one routed expert of two plus the shared one, sharded
    over ``tp``; likewise the dense FFN. The vocabulary is production's per-rank share times ``tp``.
    """
    scale = weight_bytes / 2.0
    expert_rows = GLM5_ACTIVE_EXPERT_FFN / production_tp * scale / 2  # per rank, each of the 2 active experts

    def rows(per_rank: float) -> int:  # whole multiples of 64 per rank, sharded over tp
        return max(64, round(per_rank / 64) * 64) * tp

    return TinyGlm5Spec(
        tp=tp, heads_per_rank=GLM5_HEADS // production_tp, hidden_size=GLM5_HIDDEN, num_hidden_layers=GLM5_LAYERS,
        first_k_dense_replace=GLM5_DENSE, intermediate_size=rows(GLM5_DENSE_FFN / production_tp * scale),
        moe_intermediate_size=rows(expert_rows), n_routed_experts=2, n_shared_experts=1, num_experts_per_tok=1,
        num_nextn_predict_layers=1, vocab_size=GLM5_VOCAB // production_tp * tp, q_lora_rank=2048,
        max_position_embeddings=202752)


def write_config_only(out: Path, spec: TinyGlm5Spec, *, force: bool = False) -> Path:
    """``config.json`` and the byte tokenizer, no weights: a model for ``--load-format dummy``."""
    check_dir(out, "checkpoint folder")
    spec.validate()
    if out.exists() and not force:
        raise OverlayError(f"{out}: exists; remove it or pass --force")
    with replacing_dir(out) as tmp:
        write_config_and_tokenizer(tmp, spec)
        (tmp / "checkpoint.json").write_text(json.dumps({"spec": asdict(spec), "weights": "none: --load-format dummy"},
                                                        indent=2, sort_keys=True) + "\n")
    return out
