"""Checkpoint loading: both name layouts, validation errors that name the tensor, missing MTP."""

import json
import shutil

import numpy as np
import pytest

from q27py.errors import CheckpointError, ConfigError
from q27py.model.checkpoint import Checkpoint, canonical_name
from q27py.io.safetensors import SafetensorsFile, write_safetensors
from q27py.model.config import ModelConfig, qwen36_27b_config


def test_canonical_names():
    assert canonical_name("model.language_model.layers.3.mlp.up_proj.weight") == "layers.3.mlp.up_proj.weight"
    assert canonical_name("model.layers.3.mlp.up_proj.weight") == "layers.3.mlp.up_proj.weight"
    assert canonical_name("lm_head.weight") == "lm_head.weight"
    assert canonical_name("mtp.fc.weight") == "mtp.fc.weight"
    assert canonical_name("model.visual.blocks.0.attn.qkv.weight") is None


@pytest.mark.parametrize("name", ["rand-a", "rand-b", "rand-c-vl-layout"])
def test_golden_checkpoints_open(fixtures_dir, name):
    ck = Checkpoint.open(fixtures_dir / "golden" / name)
    assert ck.has_mtp
    assert "embed_tokens.weight" in ck.names()
    assert ("lm_head.weight" in ck.names()) == (not ck.config.tie_word_embeddings)
    assert not any(n.startswith(("model.", "visual")) for n in ck.names())


def test_multimodal_config_layout(fixtures_dir):
    cfg = ModelConfig.from_model_dir(fixtures_dir / "golden" / "rand-c-vl-layout")
    assert cfg.extra["layout"] == "multimodal"
    assert cfg.hidden_size == 96 and cfg.num_key_value_heads == 1
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)


def test_full_attention_interval_derives_layer_types():
    cfg = qwen36_27b_config().to_hf_dict()
    del cfg["layer_types"]
    cfg["full_attention_interval"] = 4
    c = ModelConfig.from_dict(cfg)
    assert c.full_layers == list(range(3, 64, 4))
    assert c.gdn_conv_dim == 10240 and c.rotary_dim == 64


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.pop("hidden_size"), "hidden_size"),
        (lambda d: d.update(num_attention_heads=5), "num_attention_heads"),
        (lambda d: d.update(linear_num_value_heads=7), "linear_num_value_heads"),
        (lambda d: d.update(layer_types=["linear_attention"]), "layer_types"),
        (lambda d: d.update(layer_types=["mamba"] * 64), "layer_types"),
        (lambda d: d.update(model_type="llama"), "model_type"),
        (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
        (lambda d: d.update(vocab_size="big"), "vocab_size"),
        (lambda d: d["rope_parameters"].update(rope_type="yarn"), "rope_type"),
        (lambda d: d["rope_parameters"].update(mrope_section=[1, 1, 1]), "mrope_section"),
        (lambda d: d.update(mtp_num_hidden_layers=3), "mtp_num_hidden_layers"),
    ],
)
def test_bad_configs_name_the_field(edit, field):
    d = qwen36_27b_config().to_hf_dict()
    d["rope_parameters"]["mrope_section"] = [11, 11, 10]
    edit(d)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(d)


def _copy(src, dst):
    shutil.copytree(src, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


def _rewrite_shard(model_dir, mutate):
    """Rewrite every shard through `mutate(dict of stored name -> array)`; keeps the index consistent."""
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for fn in sorted(set(index["weight_map"].values())):
        f = SafetensorsFile(model_dir / fn)
        tensors = {n: f.get(n) for n in f.tensors}
        f.close()
        tensors = mutate(tensors)
        write_safetensors(model_dir / fn, tensors)
        for n in list(index["weight_map"]):
            if index["weight_map"][n] == fn and n not in tensors:
                del index["weight_map"][n]
        for n in tensors:
            index["weight_map"][n] = fn
    index_path.write_text(json.dumps(index))


def test_missing_tensor_is_named(fixtures_dir, tmp_path):
    d = _copy(fixtures_dir / "golden" / "rand-a", tmp_path / "m")
    _rewrite_shard(d, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.linear_attn.A_log"})
    with pytest.raises(CheckpointError, match="missing tensor 'layers.1.linear_attn.A_log'"):
        Checkpoint.open(d)


def test_misshaped_tensor_is_named(fixtures_dir, tmp_path):
    d = _copy(fixtures_dir / "golden" / "rand-a", tmp_path / "m")

    def mutate(t):
        if "model.norm.weight" in t:
            t["model.norm.weight"] = np.zeros(3, np.float32)
        return t

    _rewrite_shard(d, mutate)
    with pytest.raises(CheckpointError, match="'model.norm.weight' has shape \\[3\\]"):
        Checkpoint.open(d)


def test_unexpected_tensor_is_named(fixtures_dir, tmp_path):
    d = _copy(fixtures_dir / "golden" / "rand-a", tmp_path / "m")

    def mutate(t):
        if "model.norm.weight" in t:
            t["model.layers.0.surprise.weight"] = np.zeros(3, np.float32)
        return t

    _rewrite_shard(d, mutate)
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.surprise.weight'"):
        Checkpoint.open(d)


def test_checkpoint_without_mtp_loads(fixtures_dir, tmp_path):
    d = _copy(fixtures_dir / "golden" / "rand-b", tmp_path / "m")
    _rewrite_shard(d, lambda t: {k: v for k, v in t.items() if not k.startswith("mtp.")})
    ck = Checkpoint.open(d)
    assert not ck.has_mtp


def test_truncated_shard(fixtures_dir, tmp_path):
    d = _copy(fixtures_dir / "golden" / "rand-a", tmp_path / "m")
    shard = d / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        Checkpoint.open(d)


def test_missing_shard(fixtures_dir, tmp_path):
    d = _copy(fixtures_dir / "golden" / "rand-a", tmp_path / "m")
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        Checkpoint.open(d)
