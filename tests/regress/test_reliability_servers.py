"""Issue 35 item 4, "leftovers of a killed run": a ``vllm serve`` that ``regress`` launched must not outlive
the run. A SIGKILLed run takes its server with it; a server a killed run left anyway (an engine worker
that outlived its API server) is stopped by the next run, which says so; a port something else serves on
is refused, never judged as the server just launched; and a server whose API process died leaves no
worker behind once the run ends.

The fake ``vllm`` here is a leader that starts the stand-in server as its child in the same process
group, as ``vllm serve`` starts its engine processes.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

from regress_helpers import FIXTURE_GSM8K, REPO, STANDIN, free_port, make_profile, run_cli, wait_port

from tests.killkit import gone, kill9_when, wait_for


def _fake_vllm(tmp_path: Path, *, leader_exits: bool = False) -> Path:
    """A ``vllm`` whose ``serve`` runs the stand-in as its child (pids in ``pids``); on SIGTERM the leader
    dies alone (default action), leaving the child, as an engine core can outlive its API server."""
    pids = tmp_path / "pids"
    script = tmp_path / "vllm"
    script.write_text(f"""#!{sys.executable}
import os, subprocess, sys, time
args = sys.argv[1:]
child = subprocess.Popen([sys.executable, {str(STANDIN)!r}, "--port", args[args.index("--port") + 1],
                          "--model-name", args[1], "--gsm8k", {str(FIXTURE_GSM8K)!r}])
with open({str(pids)!r}, "a") as fh:
    fh.write(f"{{os.getpid()}} {{child.pid}}\\n")
if {leader_exits!r}:
    time.sleep(2)
    sys.exit(3)
sys.exit(child.wait())
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _pids(tmp_path: Path) -> list[tuple[int, int]]:
    path = tmp_path / "pids"
    return [(int(a), int(b)) for a, b in (ln.split() for ln in path.read_text().splitlines())] if path.exists() else []


def _kill_all(tmp_path: Path) -> None:
    for pair in _pids(tmp_path):
        for pid in pair:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def _killed_run(tmp_path: Path, profile: Path, port: int, env: dict[str, str]) -> None:
    """``overlay regress`` in launch mode, SIGKILLed once its server answers."""
    cmd = [sys.executable, "-m", "overlay", "regress", "--profile", str(profile), "--out", str(tmp_path / "out1"),
           "--skip", "gsm8k,latency", "--ready-timeout", "60"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    kill9_when(proc, lambda: wait_port(port, 0.5), "the launched server never answered")


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(tmp_path), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def test_a_killed_regress_run_takes_its_server_with_it(tmp_path: Path) -> None:
    """Issue 35 item 4 (leftovers): ``regress`` SIGKILLed left ``vllm serve`` running (GPUs and port held;
    the next run judged that server). Now the server gets SIGTERM the moment its run dies."""
    port = free_port()
    profile = make_profile(tmp_path, **{"server.vllm_bin": str(_fake_vllm(tmp_path)), "server.port": port})
    try:
        _killed_run(tmp_path, profile, port, _env(tmp_path))
        [(leader, _)] = _pids(tmp_path)
        assert wait_for(lambda: gone(leader), 15), "the server's API process outlived the killed run"
    finally:
        _kill_all(tmp_path)


def test_a_server_a_killed_run_left_is_stopped_by_the_next_run(tmp_path: Path) -> None:
    """Issue 35 item 4 (leftovers): what a killed run's server left running (here the stand-in, the leader's
    child, as an engine outliving its API server) kept the port; the next run judged *it*. Now the next
    run stops that process group, says so, and judges the server it starts."""
    port = free_port()
    profile = make_profile(tmp_path, **{"server.vllm_bin": str(_fake_vllm(tmp_path)), "server.port": port})
    env = _env(tmp_path)
    try:
        _killed_run(tmp_path, profile, port, env)
        [(leader, worker)] = _pids(tmp_path)
        assert wait_for(lambda: gone(leader), 15) and not gone(worker)  # the worker holds the port on
        run = run_cli(profile, tmp_path / "out2", "--skip", "gsm8k,latency", "--ready-timeout", "60", env=env)
        assert run.code == 0, run.stderr
        assert f"server: stopping process group {leader} on port {port} (" in run.stderr
        assert "left running by a regress run that was killed (pid " in run.stderr
        assert gone(worker)
        assert len(_pids(tmp_path)) == 2  # the run judged the server it launched
    finally:
        _kill_all(tmp_path)


def test_a_port_something_else_serves_on_is_refused_not_judged(standin, tmp_path: Path) -> None:
    """Issue 35 item 4 (leftovers): with the profile's port already served (by a server no run of this tool
    started), the launched ``vllm serve`` failed to bind and the run judged the other server. Now the run
    stops before launching: a harness failure naming the port."""
    other = standin("healthy")
    port = int(other.url.rsplit(":", 1)[1])
    profile = make_profile(tmp_path, **{"server.vllm_bin": str(_fake_vllm(tmp_path)), "server.port": port})
    try:
        run = run_cli(profile, tmp_path / "out", "--skip", "gsm8k,latency", "--ready-timeout", "30",
                      env=_env(tmp_path))
        assert run.code == 2, run.stderr
        [finding] = run.findings()
        assert finding["kind"] == "harness"
        assert finding["message"].startswith(f"server.port {port}: something already listens on 127.0.0.1:{port}, "
                                             "and no run of this tool left it there")
        assert _pids(tmp_path) == []  # nothing launched
    finally:
        _kill_all(tmp_path)


def test_a_server_whose_api_process_died_leaves_no_worker_after_the_run(tmp_path: Path) -> None:
    """Issue 35 item 4 (leftovers): when the launched server's leader had exited (a crash), ``stop`` did
    nothing and its workers stayed; now the run stops the whole group whatever its leader did."""
    port = free_port()
    profile = make_profile(tmp_path, **{"server.vllm_bin": str(_fake_vllm(tmp_path, leader_exits=True)),
                                        "server.port": port})
    try:
        run = run_cli(profile, tmp_path / "out", "--skip", "gsm8k,latency", "--ready-timeout", "30",
                      env=_env(tmp_path))
        [(leader, worker)] = _pids(tmp_path)
        assert run.report, run.stderr
        assert gone(leader) and gone(worker)
    finally:
        _kill_all(tmp_path)
