"""--model-id resolution: folders, .gguf paths, the embedded default id, and missing hub ids."""

from __future__ import annotations

import os

import pytest

from tests.modeling.helpers import smollm2_gguf_path
from tgi_compat.modeling.source import DEFAULT_MODEL_ID, resolve_model_source
from tgi_compat.modeling.weights.hub import ModelNotFoundError


def test_default_id_resolves_to_the_embedded_gguf(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # must not need the network
    for model_id in (None, DEFAULT_MODEL_ID):
        source = resolve_model_source(model_id)
        assert source.is_gguf and source.gguf_file == smollm2_gguf_path()


def test_gguf_file_path():
    source = resolve_model_source(smollm2_gguf_path())
    assert source.gguf_file == smollm2_gguf_path() and source.folder == os.path.dirname(smollm2_gguf_path())


def test_folder_with_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    source = resolve_model_source(str(tmp_path))
    assert source.folder == str(tmp_path) and not source.is_gguf


def test_folder_with_one_gguf(tmp_path):
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"GGUF")
    assert resolve_model_source(str(tmp_path)).gguf_file == str(tmp_path / "model.Q4_0.gguf")


def test_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither config.json nor a .gguf file"):
        resolve_model_source(str(tmp_path))


def test_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_source(str(tmp_path / "nope"))


def test_offline_missing_hub_id_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="'someone/not-cached'.*HF_HUB_OFFLINE is set"):
        resolve_model_source("someone/not-cached")
