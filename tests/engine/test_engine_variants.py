"""The seed-bug variant trees: each is the series without one fix (or up to it), laid over vLLM."""

from __future__ import annotations

import tarfile
import zipfile
from pathlib import Path

import pytest

from overlay.build.fetch import fetch_wheel
from overlay.build.pins import load_pin
from overlay.engine.check import lay_variant
from overlay.engine.variants import BENCH_VARIANTS, EXPECT, build_variants

REPO = Path(__file__).resolve().parents[2]
MLA = "vllm/model_executor/layers/attention/mla_attention.py"


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("variants")
    return out, build_variants(REPO / "patches", "0.28.0", out)


def _files(tar: Path) -> dict[str, bytes]:
    with tarfile.open(tar) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers()}  # type: ignore[union-attr]


def test_every_fix_has_a_variant_with_its_symptom(variants: tuple[Path, dict]) -> None:
    out, manifest = variants
    names = set(manifest["variants"])
    assert names == ({"stock"} | {f"minus-{p.removesuffix('.patch')}" for p in EXPECT if p != "stock"}
                     | set(BENCH_VARIANTS))
    for name, v in manifest["variants"].items():
        assert (out / f"{name}.tar.gz").is_file() and v["symptom"]
        assert bool(v["expect"]) == (name not in BENCH_VARIANTS)
    assert manifest["variants"]["stock"]["patches"] == []
    # a later patch builds on the decode guard: its variant is the series before it
    assert manifest["variants"]["minus-sparse-mla-decode-metadata-guard"]["patches"] == [
        "flashmla-sparse-dcp.patch", "flashmla-sparse-dcp-spec-cudagraphs.patch"]
    # the CUDA-graph fix drops cleanly too
    g = manifest["variants"]["minus-flashmla-sparse-dcp-spec-cudagraphs"]["patches"]
    assert "flashmla-sparse-dcp-spec-cudagraphs.patch" not in g and len(g) == len(manifest["series"]) - 1
    # the q-gather fallback drops cleanly: every other patch stays
    q = manifest["variants"]["minus-dcp-direct-q-gather-fallback"]["patches"]
    assert "dcp-direct-q-gather-fallback.patch" not in q and len(q) == len(manifest["series"]) - 1


def test_stock_variant_is_the_base_and_guard_variant_lacks_the_guard(variants: tuple[Path, dict]) -> None:
    out, manifest = variants
    wheel = fetch_wheel(load_pin(REPO / "patches", "0.28.0"))
    with zipfile.ZipFile(wheel) as zf:
        base_mla = zf.read(MLA)
    stock = _files(out / "stock.tar.gz")
    assert set(stock) <= set(manifest["files"]) and stock[MLA] == base_mla
    guard = _files(out / "minus-sparse-mla-decode-metadata-guard.tar.gz")
    assert b'getattr(attn_metadata, "decode"' not in guard[MLA]
    full = _files(out / "minus-dcp-direct-q-gather-fallback.tar.gz")
    assert b'getattr(attn_metadata, "decode"' in full[MLA]


def test_lay_variant_swaps_files_and_links_the_rest(variants: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = variants
    tree = lay_variant(out / "stock.tar.gz", tmp_path / "tree")
    mla = tree / MLA
    assert not mla.is_symlink() and b'getattr(attn_metadata, "decode"' not in mla.read_bytes()
    assert (tree / "vllm" / "__init__.py").is_symlink()


def test_mtp_as_prefills_brings_the_old_graph_mode_back(variants: tuple[Path, dict]) -> None:
    """bench-engine's B of the MTP A/B: the series, but MTP steps prefills and spec decoding piecewise."""
    out, manifest = variants
    sparse = "vllm/v1/attention/backends/mla/flashmla_sparse.py"
    series = _files(out / "minus-dcp-direct-q-gather-fallback.tar.gz")[sparse]
    old = _files(out / "mtp-as-prefills.tar.gz")[sparse]
    # the builder's one condition, which its reorder threshold and its CUDA-graph support both read
    keeps = b"return vllm_config.parallel_config.cp_kv_cache_interleave_size == 1\n"
    assert keeps in series and keeps not in old
    assert b"# cp_kv_cache_interleave_size 1.\n        return False\n" in old
    assert manifest["variants"]["mtp-as-prefills"]["case"] is None
    assert manifest["variants"]["mtp-as-prefills"]["patches"][:-1] == manifest["series"]


@pytest.mark.slow
def test_the_0_34_0_variants_show_what_that_release_does(tmp_path: Path) -> None:
    """On 0.34.0 (FlashMLA-sparse DCP of its own, Model Runner V2 only) the variants follow the release's own
    ``patches/0.34.0/engine.toml``: unpatched, it serves; without the CUDA-graph fix the default expectation
    stands. Every case named exists on its build."""
    from overlay.engine.workload import cases
    from overlay.maintain.trees import base_tree
    from overlay.releases import engine_cases
    from overlay.releases.facts import release_facts

    manifest = build_variants(REPO / "patches", "0.34.0", tmp_path)
    table = manifest["variants"]
    assert set(table) == {"stock", "minus-flashmla-sparse-dcp-spec-cudagraphs"}
    shows = {name: [(j["expect"], j["case"]) for j in v.get("jobs") or [v]] for name, v in table.items()}
    assert shows["stock"] == [("pass", "ref-dcp1-mtp")]
    assert shows["minus-flashmla-sparse-dcp-spec-cudagraphs"] == [
        (EXPECT["flashmla-sparse-dcp-spec-cudagraphs.patch"][0], "dcp-a2a-direct-proj1-graph-mtp-il16")]
    facts = release_facts(base_tree(REPO / "patches", "0.34.0"))  # the build's cases, by its own tree's facts
    names = {c.name for c in cases(2, facts)} | {c.name for c in cases(1, facts)}
    assert {case for s in shows.values() for _, case in s} <= names
    assert set(engine_cases.load("0.34.0").expect) <= {"stock", *EXPECT}
    builder = "vllm/v1/attention/backends/mla/flashmla_sparse.py"
    wheel = fetch_wheel(load_pin(REPO / "patches", "0.34.0"))
    with zipfile.ZipFile(wheel) as zf:
        base = zf.read(builder)
    assert _files(tmp_path / "stock.tar.gz")[builder] == base
    assert _files(tmp_path / "minus-flashmla-sparse-dcp-spec-cudagraphs.tar.gz").get(builder, base) == base


def test_a_release_table_names_what_is_wrong(tmp_path: Path) -> None:
    """A bad ``engine.toml`` is one line naming the file and each problem."""
    from overlay.releases.engine_cases import ReleaseTableError, load

    (tmp_path / "9.9.9").mkdir()
    (tmp_path / "9.9.9" / "engine.toml").write_text(
        '[acts]\n"a.patch" = ["dcp>2"]\n[[expect]]\nvariant = "stock"\nexpect = "maybe"\nsymptom = "s"\ncase = ""\n')
    with pytest.raises(ReleaseTableError) as exc:
        load("9.9.9", tmp_path)
    assert str(exc.value) == (f"{tmp_path / '9.9.9' / 'engine.toml'}: acts 'a.patch': unknown condition(s) ['dcp>2'] "
                              "(known: dcp>1, mtp, piecewise-mtp, v1-runner, projection:on, projection:off, "
                              "env:NAME=VALUE but VLLM_DCP_PROJECT_BEFORE_MERGE); expect[0]: variant and "
                              "symptom must be given, expect one of pass, mismatch, crash:<text>")
    assert load("9.9.8", tmp_path).acts == {}  # a release without the file: no acts, default expectations
    # the projection is a case's own condition, never its variable (no case sets it: each build spells it)
    (tmp_path / "9.9.9" / "engine.toml").write_text(
        '[acts]\n"a.patch" = ["dcp>1", "env:VLLM_DCP_PROJECT_BEFORE_MERGE=1"]\n"b.patch" = ["projection:off"]\n')
    with pytest.raises(ReleaseTableError, match=r"acts 'a\.patch': unknown condition\(s\) "
                                                r"\['env:VLLM_DCP_PROJECT_BEFORE_MERGE=1'\]"):
        load("9.9.9", tmp_path)
    (tmp_path / "9.9.9" / "engine.toml").write_text('[acts]\n"b.patch" = ["dcp>1", "projection:off"]\n')
    assert load("9.9.9", tmp_path).acts == {"b.patch": ("dcp>1", "projection:off")}
