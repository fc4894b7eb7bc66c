"""The code base passes the project's lint configuration (ruff, settings in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    pytest.importorskip("ruff")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_file_speaks_of_sittings():
    """History belongs in git: no file says who worked on it or in which sitting."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    pattern = r"(this|previous|next|earlier|[a-z]+th|first|second|third) session|scratch (run|timing)"
    proc = subprocess.run(["git", "grep", "-niE", pattern, "--", ".", ":!tests/test_style.py"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 1, proc.stdout
