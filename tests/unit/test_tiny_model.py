"""The tiny model is byte-identical on every build (and so on every machine)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from serve_app.config.settings import DEFAULT_MODEL_DIR

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_model.py"


def load_script():
    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_tiny_model", module)  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_two_builds_are_byte_identical(tmp_path):
    script = load_script()
    first = script.build(tmp_path / "a")
    second = script.build(tmp_path / "b")
    assert first == second == script.folder_digest(tmp_path / "a") == script.folder_digest(tmp_path / "b")
    # ... and equal to the model the app serves, built earlier by `make`.
    assert script.folder_digest(DEFAULT_MODEL_DIR) == first


def test_model_shape_fits_the_cpu_backend():
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["head_dim"] in (32, 64, 80, 96, 112, 128)
    assert config["num_hidden_layers"] == 2 and config["dtype"] == "float32"


def test_tokenizer_has_bos_and_a_chat_template(tiny_tokenizer):
    ids = tiny_tokenizer.encode("The river")
    assert ids[0] == tiny_tokenizer.bos_token_id
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<s><|user|>\nHi<|end|>\n<|assistant|>\n"
