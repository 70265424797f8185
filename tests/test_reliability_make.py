"""Issue 25 item 15: ``make build`` with ``.venv/bin/python`` a dangling link ended in "/bin/bash:
.venv/bin/python: No such file or directory" (Error 127); now one line says to remove the venv."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_dangling_venv_python_says_remove_the_venv(tmp_path: Path) -> None:
    """Issue 25 item 15: the stamp is fresh, the venv's python points at a Python that is gone."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(tmp_path / "gone" / "python3.11")
    (venv / ".overlay-tool").write_text("")  # newer than pyproject.toml: make would not reinstall
    proc = subprocess.run(["make", "--no-print-directory", f"VENV={venv}", "status"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "No such file or directory" not in proc.stderr and "Error 127" not in proc.stderr
    assert proc.stderr.splitlines()[0] == (f"make: {venv}/bin/python -> {tmp_path}/gone/python3.11 does not run "
                                           f"(its Python is gone): remove {venv} (rm -rf {venv}) and run make again")
