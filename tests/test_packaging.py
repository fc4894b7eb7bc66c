"""Install layout (`kernels/` ships as `specdec_kernels.kernels`, never as a top-level `kernels`),
the ``env`` command, and the cached conversion of the embedded model (the demo: test_demo.py)."""

import os
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
    assert "specdec_kernels/heads/smollm2-feature.pt" in names  # load_smollm2_draft's head
    assert {"specdec_kernels/panels.c", "specdec_kernels/attention.c"} <= set(names)  # C sources, built at first use


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
    assert "CPU float32 attention at a few queries: " in proc.stdout
    off = subprocess.run([sys.executable, "-m", "specdec_kernels", "env"], capture_output=True, text=True, check=True,
                         env={**os.environ, "SPECDEC_KERNELS_NO_NATIVE": "1"})
    assert "torch ops (no attention.c: turned off by SPECDEC_KERNELS_NO_NATIVE=1)" in off.stdout


def test_ci_runs_exactly_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    blocks = [block.split("```")[0] for block in readme.split("```bash")[1:3]]
    test_command = [line for line in blocks[1].splitlines() if line and not line.startswith("#")]
    assert len(test_command) == 1
    assert test_command[0].strip() in ci


@pytest.fixture
def stub_conversion(monkeypatch, tmp_path):
    """The SmolLM2 conversion with its slow parts stubbed: a 'GGUF' path, a tiny transformers
    model and a tokenizer that writes tokenizer.json; counts conversions."""
    import transformers

    from specdec_kernels import pretrained

    calls = []

    class Tokenizer:
        def save_pretrained(self, folder):
            (Path(folder) / "tokenizer.json").write_text("{}")

    def fake_model(*args, **kwargs):
        calls.append(args)
        config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1)
        return transformers.LlamaForCausalLM(config)

    monkeypatch.setattr(pretrained, "smollm2_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(pretrained, "gguf_special_token_ids", lambda path: {})  # no real GGUF file to read
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())
    return calls


def test_conversion_is_cached_and_cleans_up_after_crashes(stub_conversion, monkeypatch, tmp_path):
    from specdec_kernels.pretrained import SMOLLM2_NAME, smollm2_folder

    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(cache))
    (cache / f".{SMOLLM2_NAME}-tmp-crashed").mkdir(parents=True)  # what a killed conversion leaves
    (cache / SMOLLM2_NAME).mkdir()                                   # an incomplete folder
    folder = smollm2_folder()
    assert folder == cache / SMOLLM2_NAME and (folder / "model.safetensors").is_file()
    assert sorted(p.name for p in cache.iterdir()) == [f".{SMOLLM2_NAME}.lock", SMOLLM2_NAME]
    assert smollm2_folder() == folder and len(stub_conversion) == 1  # converted once, then cached


@pytest.mark.parametrize("cache", ["a file", "under a file"])
def test_unusable_cache_folder_says_what_to_do(stub_conversion, monkeypatch, tmp_path, cache):
    from specdec_kernels.pretrained import ModelNotInstalledError, smollm2_folder

    (tmp_path / "file").write_text("not a folder")
    target = tmp_path / "file" if cache == "a file" else tmp_path / "file" / "cache"
    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(target))
    with pytest.raises(ModelNotInstalledError, match="SPECDEC_KERNELS_CACHE"):
        smollm2_folder()
    assert not stub_conversion  # refused before the slow conversion


def test_cache_folder_override_expands_home_and_ignores_empty(monkeypatch):
    from specdec_kernels.pretrained import cache_dir

    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "specdec_kernels"
    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", "~/models")
    assert cache_dir() == Path.home() / "models"


def test_missing_converter_says_how_to_install(stub_conversion, monkeypatch, tmp_path):
    import importlib.util

    from specdec_kernels.pretrained import ModelNotInstalledError, smollm2_folder

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "gguf" else find_spec(name, *a, **k))
    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelNotInstalledError, match=r"specdec_kernels\[hf\]"):
        smollm2_folder()


def test_conversion_without_file_locks_leaves_other_temp_folders_alone(stub_conversion, monkeypatch, tmp_path):
    """Where the file system refuses locks, conversion still works, but a temp folder may belong to
    a conversion running elsewhere, so it is not removed."""
    import fcntl

    from specdec_kernels.pretrained import SMOLLM2_NAME, smollm2_folder

    def no_locks(*args):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_KERNELS_CACHE", str(cache))
    (cache / f".{SMOLLM2_NAME}-tmp-other").mkdir(parents=True)
    assert (smollm2_folder() / "model.safetensors").is_file()
    assert (cache / f".{SMOLLM2_NAME}-tmp-other").is_dir()
