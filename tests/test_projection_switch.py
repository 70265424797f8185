"""The projection before the DCP merge spelled the way each build reads it (``overlay/releases/projection.py``):
the switch is a release fact read from the tree (our 0.34.0 series: the engine argument; 0.28.0's: the
variable; a bare release: none), and every tool that sets it gets that build's spelling or one line saying
why it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

from overlay.build.pins import carried_releases
from overlay.build.series import Series
from overlay.releases import derive
from overlay.releases.facts import release_facts
from overlay.releases.projection import ProjectionError, engine_settings, server_settings, value_of_env
from overlay.releases.source import open_tree
from tests import factskit
from tests.releasekit import installed_release

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"


def test_each_shape_reads_its_switch() -> None:
    assert [factskit.facts("0.34.0", projection=p).projection_switch for p in ("argument", "env", None)] == [
        "argument", "env", None]
    assert all(factskit.facts(v).projection_switch is None for v in factskit.SHAPES)  # the bare releases


@pytest.mark.slow
@pytest.mark.parametrize("release", carried_releases(PATCHES))
def test_each_carried_series_has_its_switch_and_the_bare_release_none(release: str) -> None:
    """0.28.0's series reads the variable, 0.34.0's has the engine argument, both bare releases neither: read
    from the patched and the base trees (the installed build's own tree where it is the release)."""
    from overlay.maintain.trees import base_tree, prefix_tree

    patched = (_installed_tree() if release == installed_release()
               else prefix_tree(PATCHES, release, Series.load(PATCHES / release).patches))
    want = {"0.28.0": "env"}.get(release, "argument")
    assert derive.projection_switch(open_tree(base_tree(PATCHES, release))) is None
    assert release_facts(patched).projection_switch == want


def _installed_tree() -> Path:
    import vllm

    return Path(vllm.__file__).parent.parent


@pytest.mark.parametrize(("switch", "value", "args", "env"), [
    ("argument", "on", ["--dcp-v-up-proj-before-merge", "on"], {}),
    ("argument", "off", ["--dcp-v-up-proj-before-merge", "off"], {}),
    ("argument", "auto", ["--dcp-v-up-proj-before-merge", "auto"], {}),
    ("env", "on", [], {"VLLM_DCP_PROJECT_BEFORE_MERGE": "1"}),
    ("env", "off", [], {"VLLM_DCP_PROJECT_BEFORE_MERGE": "0"}),
    ("env", "auto", [], {}),
    (None, "auto", [], {}),
])
def test_a_value_is_spelled_the_builds_way(switch: str | None, value: str, args: list[str],
                                           env: dict[str, str]) -> None:
    assert server_settings(switch, value) == (args, env)
    kwargs, env_in_process = engine_settings(switch, value)
    assert kwargs == ({"dcp_v_up_proj_before_merge": value} if switch == "argument" else {})
    assert env_in_process == env


def test_what_a_build_cannot_take_is_one_line() -> None:
    with pytest.raises(ProjectionError, match=r"^vllm 0\.34\.0 has no switch .* cannot be turned on$"):
        server_settings(None, "on", "vllm 0.34.0")
    with pytest.raises(ProjectionError, match=r"^projection 'yes': expected one of on, off, auto$"):
        server_settings("argument", "yes")
    with pytest.raises(ProjectionError, match=r"^profile\.yaml: VLLM_DCP_PROJECT_BEFORE_MERGE='true': expected 0"):
        value_of_env("true", "profile.yaml")
    assert [value_of_env(v, "x") for v in (None, "0", "1")] == [None, "off", "on"]


def test_the_switch_is_a_row_of_the_facts() -> None:
    rows = dict(factskit.facts("0.34.0", projection="argument").rows())
    assert rows["projection before the DCP merge"].startswith("--dcp-v-up-proj-before-merge auto|on|off")
    assert dict(factskit.facts("0.28.0", projection="env").rows())["projection before the DCP merge"].startswith(
        "VLLM_DCP_PROJECT_BEFORE_MERGE=1|0")
