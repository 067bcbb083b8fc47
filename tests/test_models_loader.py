"""Loader behaviour: formats it accepts, dtype choice, MTP tensors, and the errors it raises."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from outrider.attention import AttentionMetadata, KVCache
from outrider.attention.torch_ref import TorchReferenceBackend
from outrider.layers.rotary import rope_inv_freq
from outrider.models import load_model, read_tensors, registry, resolve_model_path
from outrider.models.decoder import CausalLM, DecoderLayer
from outrider.testing import write_tiny_checkpoint


def _copy(src, tmp_path):
    return shutil.copytree(src, tmp_path / "ckpt")


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _logits(model, cfg, ids):
    t = len(ids)
    kv = KVCache.allocate(cfg.num_hidden_layers, 4, 16, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    meta = AttentionMetadata(slot_mapping=torch.arange(t), query_start_loc=torch.tensor([0, t], dtype=torch.int32),
                             seq_lens=torch.tensor([t], dtype=torch.int32),
                             block_tables=torch.arange(4, dtype=torch.int32)[None], max_query_len=t, max_seq_len=t)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(t), kv, meta, TorchReferenceBackend()).hidden)


def test_loads_strict_eval_and_ties(tiny_checkpoint):
    model, cfg = load_model(tiny_checkpoint("qwen3", tie=True))
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_vocab_matches_tokenizer_and_special_ids(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    cfg = json.loads((path / "config.json").read_text())
    tok = json.loads((path / "tokenizer.json").read_text())
    assert cfg["vocab_size"] == len(tok["model"]["vocab"]) + len(
        [t for t in tok["added_tokens"] if t["content"] not in tok["model"]["vocab"]])
    assert cfg["eos_token_id"] is not None
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == cfg["eos_token_id"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_load(tiny_checkpoint, dtype):
    path = tiny_checkpoint("llama")
    ref, cfg = load_model(path)
    model, _ = load_model(path, dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    ids = [1, 5, 9, 33, 70]
    logits = _logits(model, cfg, ids)
    assert logits.dtype == torch.float32
    assert (logits.argmax(-1) == _logits(ref, cfg, ids).argmax(-1)).float().mean() >= 0.6


def test_auto_dtype_is_float32_on_cpu(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen2", dtype=torch.bfloat16, tokenizer=False)
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, _ = load_model(path, dtype="auto")
    assert model.lm_head.weight.dtype == torch.float32
    assert load_model(path, dtype="bfloat16")[0].lm_head.weight.dtype == torch.bfloat16


def test_transformers5_rope_parameters_config(tiny_checkpoint, tmp_path):
    """A config.json re-saved by transformers 5 (rope_parameters, dtype) loads to the same logits."""
    transformers = pytest.importorskip("transformers")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    src = tiny_checkpoint("llama", rope_scaling=scaling, rope_theta=500000.0, tokenizer=False)
    path = _copy(src, tmp_path)
    transformers.AutoConfig.from_pretrained(path).save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    assert saved.get("rope_parameters", {}).get("rope_type") == "llama3"
    (a, cfg_a), (b, cfg_b) = load_model(src), load_model(path)
    assert cfg_b.rope_scaling["factor"] == 8.0 and cfg_b.rope_theta == 500000.0
    ids = list(range(1, 40))
    torch.testing.assert_close(_logits(a, cfg_a, ids), _logits(b, cfg_b, ids))


def test_llama3_inv_freq_matches_transformers():
    mrope = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf_cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_scaling=scaling, rope_theta=500000.0,
                         max_position_embeddings=131072)
    ref, _ = mrope.ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, scaling, 131072), ref)


def test_mtp_tensors_are_ignored_by_the_model_and_readable(tmp_path):
    mtp = {"mtp.fc.weight": torch.ones(4, 8), "model.mtp_layers.0.norm.weight": torch.ones(8)}
    path = write_tiny_checkpoint(tmp_path, "qwen3", tokenizer=False, extra_tensors=mtp, shards=2,
                                 extra_config={"mtp_num_hidden_layers": 1})
    model, cfg = load_model(path)
    assert cfg.mtp_num_hidden_layers == 1
    assert not any("mtp" in n for n, _ in model.named_parameters())
    assert set(read_tensors(path, "mtp.")) == {"mtp.fc.weight"}
    assert set(read_tensors(path, "model.mtp_layers.")) == {"model.mtp_layers.0.norm.weight"}


def test_unsupported_architecture(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("llama", tokenizer=False), tmp_path)
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(path)


def test_the_refusal_lists_every_registered_architecture(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("llama", tokenizer=False), tmp_path)
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as refused:
        load_model(path)
    names = [n for a in registry.architectures() for n in a.hf_names]
    assert {"MistralForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"} <= set(names)
    assert str(refused.value).endswith("supported: " + ", ".join(sorted(names)))


def test_an_architecture_name_belongs_to_one_module():
    registry.architectures()  # (the modules register on first use)
    with pytest.raises(ValueError, match=r"architecture 'copy' claims \['LlamaForCausalLM'\], already 'llama'"):
        registry.register(registry.Architecture(name="copy", hf_names=("LlamaForCausalLM",), model_type="llama",
                                                model=CausalLM, decoder_layer=DecoderLayer))
    assert "copy" not in [a.name for a in registry.architectures()]


@pytest.mark.parametrize("changes, refusal", [
    ({"hidden_act": "relu2"}, "MLP activation 'relu2' is not supported"),
    ({"layer_types": ["full_attention", "linear_attention"]}, "layer 1 is 'linear_attention'"),
    ({"layer_types": ["full_attention"]}, "layer_types lists 1 layers; the model has 2"),
], ids=["activation", "layer-type", "layer-count"])
def test_what_the_decoder_cannot_run_is_refused_by_name(tiny_checkpoint, tmp_path, changes, refusal):
    path = _copy(tiny_checkpoint("llama", tokenizer=False), tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=refusal):
        load_model(path)


def test_phi3_with_partial_rotary_is_refused(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("phi3", tokenizer=False), tmp_path)
    _edit_config(path, partial_rotary_factor=0.75)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75"):
        load_model(path)


def test_missing_packed_tensor_is_named(tiny_checkpoint, tmp_path):
    """Phi-3 stores qkv_proj whole: that is the name a checkpoint without it is missing."""
    path = _copy(tiny_checkpoint("phi3", tokenizer=False), tmp_path)
    _edit_weights(path, lambda t: t.pop("model.layers.0.self_attn.qkv_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.0\.self_attn\.qkv_proj\.weight'"):
        load_model(path)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("llama", tokenizer=False), tmp_path)
    _edit_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(path)


def test_untied_checkpoint_without_lm_head_is_missing_it(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("qwen2", tokenizer=False), tmp_path)
    _edit_weights(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
        load_model(path)


def test_shape_mismatch_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("qwen2", tokenizer=False), tmp_path)
    _edit_weights(path, lambda t: t.update({"model.layers.0.self_attn.k_proj.bias": torch.zeros(7)}))
    with pytest.raises(ValueError, match=r"shape mismatch for 'model\.layers\.0\.self_attn\.k_proj\.bias': "
                                         r"expected \(32,\), got \(7,\)"):
        load_model(path)


def test_unexpected_tensor_is_an_error(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("qwen3", tokenizer=False), tmp_path)
    _edit_weights(path, lambda t: t.update({"model.layers.0.mlp.gate_proj.bias": torch.zeros(128)}))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mlp.gate_proj.bias'"):
        load_model(path)


def test_unknown_repo_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="cannot find model 'nobody/no-such-model'"):
        resolve_model_path("nobody/no-such-model", offline=True)
