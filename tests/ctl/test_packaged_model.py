"""The demo's model ships in the package (issue 10 "The demo speaks English"): pyproject's
package-data names every file of kafila_ctl/models/stories260K, the licence is there, and the
directory loads as the demo serves it."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pytest

from kafila_ctl.demo import DEMO_MODEL, model_ref, packaged_model_dir, printable, shipped_models
from kafilad.errors import KafilaError

REPO = Path(__file__).resolve().parent.parent.parent
FILES = {"LICENSE", "README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"}


def test_package_data_covers_the_model_files():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = cfg["tool"]["setuptools"]["package-data"]["kafila_ctl"]
    model = REPO / "kafila_ctl" / "models" / DEMO_MODEL
    present = {p.name for p in model.iterdir() if p.is_file()}
    assert present == FILES
    for name in FILES:
        rel = f"models/{DEMO_MODEL}/{name}"
        assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), rel
    assert packaged_model_dir() == model


def test_licence_and_source_are_named():
    model = packaged_model_dir()
    licence = (model / "LICENSE").read_text()
    assert licence.startswith("MIT License\n\nCopyright (c) 2023 Andrej\n")
    assert "THE SOFTWARE IS PROVIDED \"AS IS\"" in licence
    readme = (model / "README.md").read_text()
    assert "karpathy/llama2.c" in readme and "karpathy/tinyllamas/stories260K" in readme


def test_packaged_model_tokenizes_and_decodes():
    import kafilad.executor  # noqa: F401 - OpenBLAS before mlx, as in the daemon
    from kafilad.executor.synth import load_tokenizer
    tok = load_tokenizer(packaged_model_dir())
    assert tok.encode("Once upon a time") == [1, 403, 407, 261, 378] and tok.eos_token_ids == {2}


def test_printable_escapes_control_characters():
    assert printable("a\x00b\x1bc\nd\te") == "a\\x00b\\x1bc\nd\te"
    assert printable("Lily é €") == "Lily é €"


def test_model_ref_resolves_shipped_names_after_paths_and_repo_ids(tmp_path, monkeypatch):
    """`--model NAME`: a repo id as given, an existing path absolute, else a shipped model's directory."""
    monkeypatch.chdir(tmp_path)
    assert shipped_models() == [DEMO_MODEL]
    assert model_ref("stories260K") == model_ref("stories260k") == str(packaged_model_dir())
    assert model_ref("karpathy/stories260K") == "karpathy/stories260K"  # the daemon resolves repo ids
    (tmp_path / "stories260K").mkdir()
    assert model_ref("stories260K") == str(tmp_path / "stories260K")  # a real directory here wins
    assert model_ref("./gone") == str(tmp_path / "gone")  # a path-like name: the daemon says what it lacks
    with pytest.raises(KafilaError) as e:
        model_ref("stories26")
    assert str(e.value) == (
        f"There is no model 'stories26': it is not a directory here ({tmp_path / 'stories26'}), not one of the "
        "models shipped with kafila (stories260K), and not a Hugging Face repo id (ORG/NAME). Pass a model "
        "directory, a shipped model's name, or a repo id.")
