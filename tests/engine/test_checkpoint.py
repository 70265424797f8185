"""The generated GLM-5-architecture checkpoint: deterministic, loadable as GLM-5, tokenizer exact."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from overlay.engine.checkpoint import (
    TinyGlm5Spec,
    checkpoint_id,
    config_dict,
    generate,
    weight_recipes,
)
from overlay.errors import OverlayError

# Small enough to generate and load in a second; same structure as the default.
SMALL = TinyGlm5Spec(tp=1, heads_per_rank=2, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                     n_routed_experts=4, num_experts_per_tok=4, q_lora_rank=32, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_topk=16, index_head_dim=16,
                     index_n_heads=4, vocab_size=300, num_hidden_layers=2)


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_default_spec_has_glm5_attention_dimensions() -> None:
    cfg = config_dict(TinyGlm5Spec())
    assert cfg["architectures"] == ["GlmMoeDsaForCausalLM"] and cfg["model_type"] == "glm_moe_dsa"
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]) == (
        512, 64, 192, 256)
    assert (cfg["index_topk"], cfg["index_head_dim"], cfg["index_n_heads"]) == (2048, 128, 32)
    assert cfg["num_attention_heads"] == 16  # 8 per rank at TP 2
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["n_routed_experts"] > 1
    assert cfg["num_experts_per_tok"] == cfg["n_routed_experts"]  # no hard expert choice


def test_generation_is_deterministic_and_seeded(tmp_path: Path) -> None:
    a = generate(tmp_path / "a", SMALL, seed=7)
    b = generate(tmp_path / "b", SMALL, seed=7)
    c = generate(tmp_path / "c", SMALL, seed=8)
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]
    assert json.loads((a / "checkpoint.json").read_text())["id"] == checkpoint_id(SMALL, 7)


def test_existing_folder_is_kept_or_refused(tmp_path: Path) -> None:
    out = generate(tmp_path / "m", SMALL, seed=1)
    before = (out / "model.safetensors").stat().st_mtime_ns
    generate(out, SMALL, seed=1)  # same id: kept as it is
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(OverlayError, match="is not checkpoint"):
        generate(out, SMALL, seed=2)
    generate(out, SMALL, seed=2, force=True)
    assert json.loads((out / "checkpoint.json").read_text())["seed"] == 2


def test_bad_spec_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(OverlayError, match="hidden_size"):
        generate(tmp_path / "x", replace(SMALL, hidden_size=0))
    assert not (tmp_path / "x").exists()


def test_transformers_loads_it_as_glm5_with_only_the_mtp_layer_extra(tmp_path: Path) -> None:
    """Every weight GLM-5's own modelling code has is there with its shape; the rest is the MTP layer."""
    transformers = pytest.importorskip("transformers")
    out = generate(tmp_path / "m", SMALL, seed=0)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert type(model).__name__ == "GlmMoeDsaForCausalLM"
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["mismatched_keys"]
    mtp = f"model.layers.{SMALL.num_hidden_layers}."
    assert info["unexpected_keys"] and all(k.startswith(mtp) for k in info["unexpected_keys"])


def test_mtp_layer_has_what_vllms_mtp_loader_reads() -> None:
    names = set(weight_recipes(SMALL))
    p = f"model.layers.{SMALL.num_hidden_layers}"
    for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                   "shared_head.head.weight", "embed_tokens.weight", "self_attn.indexer.wq_b.weight",
                   "mlp.gate.e_score_correction_bias", "mlp.experts.0.down_proj.weight"):
        assert f"{p}.{suffix}" in names
    from transformers import PretrainedConfig
    from vllm.model_executor.models.deepseek_mtp import get_spec_layer_idx_from_weight_name

    cfg = PretrainedConfig(num_hidden_layers=SMALL.num_hidden_layers, num_nextn_predict_layers=1)
    assert get_spec_layer_idx_from_weight_name(cfg, f"{p}.eh_proj.weight") == SMALL.num_hidden_layers
    assert get_spec_layer_idx_from_weight_name(cfg, "model.layers.0.mlp.gate_proj.weight") is None


def test_vllm_model_config_reads_it(tmp_path: Path) -> None:
    out = generate(tmp_path / "m", SMALL, seed=0)
    from vllm.config import ModelConfig

    mc = ModelConfig(model=str(out), tokenizer=str(out))
    assert mc.architectures == ["GlmMoeDsaForCausalLM"]
    assert mc.use_mla and mc.hf_config.index_topk == SMALL.index_topk
    assert mc.get_vocab_size() == SMALL.vocab_size


def test_tokenizer_is_byte_level_and_covers_the_vocabulary(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = generate(tmp_path / "m", SMALL, seed=0)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "GLM-5 über alles\n\t{}"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert len(tok) == SMALL.vocab_size
    assert tok.eos_token_id == 256
    assert tok.decode([299, 65], skip_special_tokens=True) == "A"  # reserved ids decode to nothing


def test_glm5_per_rank_matches_production_bytes_per_rank(tmp_path: Path) -> None:
    """GLM-5's depth and attention at TP8's 8 heads per rank; FFN bytes a token reads per rank as NVFP4's."""
    from overlay.engine.checkpoint import (
        GLM5_ACTIVE_EXPERT_FFN,
        GLM5_HIDDEN,
        NVFP4_BYTES,
        glm5_per_rank,
        write_config_only,
    )

    spec = glm5_per_rank(2)
    assert (spec.num_hidden_layers, spec.first_k_dense_replace, spec.heads_per_rank, spec.num_heads) == (78, 3, 8, 16)
    assert (spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim) == (512, 192, 64, 256)
    # bytes a token reads from the routed + shared experts, per rank and layer
    ours = (spec.num_experts_per_tok + spec.n_shared_experts) * 3 * GLM5_HIDDEN * spec.moe_intermediate_size / 2 * 2
    production = GLM5_ACTIVE_EXPERT_FFN / 8 * 3 * GLM5_HIDDEN * NVFP4_BYTES
    assert abs(ours / production - 1) < 0.05
    assert glm5_per_rank(1).vocab_size * 2 == spec.vocab_size == 154880 // 8 * 2
    out = write_config_only(tmp_path / "glm5", spec)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 78 and config["num_attention_heads"] == 16
    assert not list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()
    with pytest.raises(OverlayError, match="exists"):
        write_config_only(out, spec)


def test_a_damaged_checkpoint_is_generated_again_not_reused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 25 item 17: a folder whose model.safetensors was cut to 1000 bytes and whose tokenizer.json was
    deleted was reused (exit 0); now the sizes are checked before reuse and the checkpoint is made again."""
    out = generate(tmp_path / "m", SMALL, seed=1)
    good = _digests(out)
    with (out / "model.safetensors").open("r+b") as fh:
        fh.truncate(1000)
    (out / "tokenizer.json").unlink()
    generate(out, SMALL, seed=1)
    err = capsys.readouterr().err
    assert "model.safetensors is 1000 bytes" in err and "tokenizer.json is missing" in err
    assert "generating it again" in err
    assert _digests(out) == good


def test_verify_checks_the_digests_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 25 item 17 (digest when asked): a same-size edit passes the size check, not ``verify``."""
    out = generate(tmp_path / "m", SMALL, seed=1)
    good = _digests(out)
    text = (out / "config.json").read_text()
    (out / "config.json").write_text(text.replace('"', "'", 1))
    before = (out / "model.safetensors").stat().st_mtime_ns
    generate(out, SMALL, seed=1)  # same sizes: kept
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    generate(out, SMALL, seed=1, verify=True)
    assert "config.json's sha256 is not the one written" in capsys.readouterr().err and _digests(out) == good


@pytest.mark.parametrize("where", ["proc", "under-a-file"])
def test_an_unwritable_out_is_refused_before_anything_is_drawn(tmp_path: Path, where: str) -> None:
    """Issue 25 item 6: ``engine-checkpoint --out /proc/ckpt`` or ``--out <a file>/ck``: one line, exit 2."""
    from overlay.cli import main

    (tmp_path / "file").write_text("x")
    out = Path("/proc/ckpt") if where == "proc" else tmp_path / "file" / "ck"
    from overlay.outpaths import OutPathError

    with pytest.raises(OutPathError) as exc:
        generate(out, SMALL)
    assert exc.value.exit_code == 2
    assert str(exc.value).startswith(f"checkpoint folder {out}: ")
    assert ("cannot write in /proc" if where == "proc" else f"{tmp_path / 'file'} is a file") in str(exc.value)
    assert main(["engine-checkpoint", "--out", str(out)]) == 2
