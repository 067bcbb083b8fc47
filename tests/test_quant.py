"""Quantized weights (outrider/quant) on the CPU: the dequantizers against ggml's reference, checkpoints that keep
their weights quantized (GGUF types mixed per tensor, FP8, AWQ, GPTQ, FP8 at load time) computing what the same
weights dense compute, the fallback of types without kernels, and the memory the weights take."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.config import PREFILL_GRAPH_TOKENS, QUANTIZED_PREFILL_GRAPH_TOKENS
from outrider.layers.linear import MergedLinear
from outrider.models import load_model
from outrider.models.loader import read_tensors
from outrider.quant.dequant import dequantize_fp8, dequantize_int4
from outrider.quant.formats import GGUF_FORMATS, FP8Format, Int4Format
from outrider.quant.layers import QuantizedEmbedding, QuantizedLinear
from outrider.quant.weight import QuantizedWeight
from outrider.quant.writers import (checkpoint_shapes, gguf_tensor_type, quantize_gguf, quantize_int4,
                                    write_quantized_checkpoint, write_random_gguf)
from outrider.testing.checkpoints import write_tiny_checkpoint
from outrider.testing.gguf import write_gguf

gguf = pytest.importorskip("gguf")

# float16 scales at the edges: largest finite, smallest normal and subnormal, zero, negative, infinities, NaN
EXTREME_F16 = np.array([65504.0, -65504.0, 6.1035e-05, 5.96e-08, 0.0, -0.0, -1.5, np.inf, -np.inf, np.nan],
                       dtype=np.float16)
SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,)}


def _blocks(kind: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random bytes for `blocks` blocks per row, the float16 scale fields cycling through EXTREME_F16 (and random
    ones in between)."""
    fmt = GGUF_FORMATS[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows * blocks, fmt.type_size), dtype=np.uint8)
    for field in SCALE_FIELDS[kind]:
        extreme = EXTREME_F16[rng.integers(0, len(EXTREME_F16), len(data))].view(np.uint8).reshape(-1, 2)
        pick = rng.random(len(data)) < 0.5
        data[pick, field:field + 2] = extreme[pick]
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", GGUF_FORMATS)
def test_gguf_dequantizers_are_bit_exact_with_ggml_reference(kind):
    from outrider.quant.dequant import dequantize_gguf

    for seed in range(3):
        raw = _blocks(kind, 16, 9, seed)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
        got = dequantize_gguf(GGUF_FORMATS[kind], torch.from_numpy(raw)).numpy()
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)) or np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("kind", GGUF_FORMATS)
def test_quantizers_write_blocks_that_ggml_reads_back_close_to_the_weights(kind):
    w = np.random.default_rng(0).normal(0, 0.05, (8, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_gguf(w, kind), gguf.GGMLQuantizationType[kind])
    bits = GGUF_FORMATS[kind].bits_per_weight()
    assert np.abs(back - w).max() <= 0.25 * np.abs(w).max() * 2 ** (4 - int(bits))


def test_fp8_and_int4_dequantizers():
    data = torch.tensor([[1.0, -2.0, 0.5], [448.0, 0.0, -0.25]]).to(torch.float8_e4m3fn)
    got = dequantize_fp8(FP8Format(1, 0), data, torch.tensor([[2.0], [0.5]]))
    assert torch.equal(got, torch.tensor([[2.0, -4.0, 1.0], [224.0, 0.0, -0.125]]))
    q = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)
    zero, scale = torch.tensor([[3, 8]], dtype=torch.uint8), torch.tensor([[0.5, 2.0]], dtype=torch.float16)
    from outrider.quant.checkpoint import pack_int4

    part = pack_int4(Int4Format(32, "AWQ"), q, zero, scale)
    want = (q.float().view(1, 2, 32) - zero.float()[..., None]) * scale.float()[..., None]
    assert torch.equal(dequantize_int4(part.format, part.data, part.scale, part.zero), want.view(1, 64))


# --- GGUF ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {arch: write_tiny_checkpoint(root / arch, arch, hidden_size=256, intermediate_size=512, layers=2,
                                        heads=4, kv_heads=2, tie=arch == "qwen3")
            for arch in ("llama", "qwen2", "qwen3")}


def _greedy(model_path, **kwargs) -> list[list[int]]:
    llm = LLM(str(model_path), dtype="float32", max_model_len=128, num_kv_blocks=32, max_num_seqs=4, **kwargs)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in llm.generate([[1, 17, 99, 200, 7], list(range(30, 53))], params)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"])
def test_gguf_weights_stay_quantized_and_compute_what_the_dequantized_path_does(tiny, tmp_path, arch, quant):
    """Projections (packed ones too), the embedding and an untied LM head keep the file's blocks; logits equal the
    dequantized-at-load model's exactly (float32 on the CPU: the same weights, the same products)."""
    path = write_gguf(tiny[arch], tmp_path / f"{arch}.gguf", quant=quant)
    ours, cfg = load_model(path, quantization="keep")
    ref, _ = load_model(path, quantization="none")
    attn = ours.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantizedLinear) and attn.qkv_proj.weight.format_names() == [quant]
    assert isinstance(ours.model.embed_tokens, QuantizedEmbedding) and isinstance(ours.lm_head, QuantizedLinear)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == cfg.tie_word_embeddings
    assert (attn.qkv_proj.bias is not None) == (arch == "qwen2")
    assert not any(p.dim() == 2 for p in ours.parameters())
    assert torch.equal(attn.qkv_proj.weight.dequantize(), ref.model.layers[0].self_attn.qkv_proj.weight)
    ids = torch.tensor([1, 17, 99, 200, 7])
    assert torch.equal(ours.embed(ids), ref.embed(ids))
    hidden = torch.randn(3, cfg.hidden_size)
    assert torch.equal(ours.compute_logits(hidden), ref.compute_logits(hidden))


def test_q4_k_m_mix_keeps_each_tensor_in_its_type_and_computes_the_dequantized_logits(tmp_path):
    """llama.cpp's Q4_K_M: v_proj and down_proj in Q6_K on some layers, so a packed qkv holds two formats."""
    config = {**json.loads((write_tiny_checkpoint(tmp_path / "ck", "qwen3", hidden_size=256, intermediate_size=512,
                                                  layers=8) / "config.json").read_text())}
    path = write_random_gguf(tmp_path / "m.gguf", config, "q4_k_m")
    model, _ = load_model(path, quantization="keep")
    for i, layer in enumerate(model.model.layers):
        v_type = gguf_tensor_type("q4_k_m", f"model.layers.{i}.self_attn.v_proj.weight", 8)
        want = ["Q4_K"] if v_type == "Q4_K" else ["Q4_K", "Q6_K"]
        assert layer.self_attn.qkv_proj.weight.format_names() == want
        assert layer.mlp.down_proj.weight.format_names() == [gguf_tensor_type(
            "q4_k_m", f"model.layers.{i}.mlp.down_proj.weight", 8)]
    assert {gguf_tensor_type("q4_k_m", f"model.layers.{i}.mlp.down_proj.weight", 8) for i in range(8)} == {
        "Q4_K", "Q6_K"}
    assert model.lm_head.weight.format_names() == ["Q6_K"]
    ref, _ = load_model(path, quantization="none")
    hidden = torch.randn(2, 256)
    assert torch.equal(model.compute_logits(hidden), ref.compute_logits(hidden))


@pytest.mark.parametrize("quant", ["Q4_0", "Q5_K"])
def test_greedy_tokens_of_a_quantized_gguf_equal_the_dequantized_path(tiny, tmp_path, quant):
    path = write_gguf(tiny["llama"], tmp_path / "g.gguf", quant=quant)
    assert _greedy(path, quantization="keep") == _greedy(path)  # (auto on the CPU: dequantized at load)


def test_types_without_kernels_are_dequantized_and_the_log_names_them(tiny, tmp_path, caplog):
    path = write_gguf(tiny["qwen3"], tmp_path / "q3.gguf", quant="Q3_K")
    with caplog.at_level(logging.INFO, logger="outrider.models"):
        model, _ = load_model(path, quantization="keep")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, MergedLinear)
    line = next(r.getMessage() for r in caplog.records if "dequantized at load time" in r.getMessage())
    assert "Q3_K (" in line and "model.layers.0.self_attn.q_proj.weight" in line


def test_a_packed_projection_with_a_dense_part_is_dequantized_whole(tiny):
    """A qkv whose v is not quantized cannot stay quantized: the module loads dense, its parts listed as
    dequantized (for the log)."""
    from outrider.models import registry
    from outrider.quant.checkpoint import make_plan

    cfg = registry.load_config(tiny["qwen3"])
    with torch.device("meta"):
        meta = registry.build_model(cfg)
    offered = {n: GGUF_FORMATS["Q8_0"] for n in checkpoint_shapes(json.loads(
        (tiny["qwen3"] / "config.json").read_text())) if n.endswith("_proj.weight") and "v_proj" not in n}
    plan = make_plan(meta, "gguf", offered)
    assert "model.layers.0.self_attn.qkv_proj" not in plan.modules
    assert "model.layers.0.self_attn.o_proj" in plan.modules
    assert plan.dequantized["model.layers.0.self_attn.q_proj.weight"] == "Q8_0"


# --- Hugging Face quantized checkpoints ----------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["awq", "gptq", "fp8"])
def test_quantized_safetensors_load_quantized_and_compute_their_dequantized_weights(tiny, tmp_path, method):
    """The projections stay quantized (INT4 repacked from AWQ/GPTQ, FP8 block-wise), each equal to the checkpoint's
    own dequantization: (q - zero) * scale per group, or value * block scale."""
    src = tiny["qwen2"]
    config = json.loads((src / "config.json").read_text())
    dense = read_tensors(src)
    out = write_quantized_checkpoint(config, dense.items(), tmp_path / method, method, group=128)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((src / f).read_bytes())
    model, _ = load_model(out, quantization="keep")
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and qkv.bias is not None
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding) and not isinstance(model.lm_head,
                                                                                          QuantizedLinear)
    w = dense["model.layers.1.self_attn.k_proj.weight"]
    rows = slice(qkv.sizes[0], qkv.sizes[0] + w.shape[0])
    got = qkv.weight.dequantize()[rows]
    if method == "fp8":
        assert qkv.weight.format_names() == ["FP8 (128x128 blocks)"]
        torch.testing.assert_close(got, w, rtol=0.07, atol=1e-3)
    else:
        q, zero, scale = quantize_int4(w, 128)
        want = ((q.float().unflatten(1, (-1, 128)) - zero.float()[..., None]) * scale.float()[..., None]).flatten(1)
        assert torch.equal(got, want)
    stored = sum(t.numel() * t.element_size() for n, t in read_tensors(out).items() if "_proj." in n)
    assert sum(p.nbytes for m in model.modules() if isinstance(m, QuantizedWeight) for p in m.parts) <= 1.05 * stored
    dense, _ = load_model(out)  # auto on the CPU: dequantized at load
    assert isinstance(dense.model.layers[1].self_attn.qkv_proj, MergedLinear)
    assert torch.equal(dense.model.layers[1].self_attn.qkv_proj.weight, qkv.weight.dequantize())
    assert _greedy(out, quantization="keep") == _greedy(out)


def test_quantization_fp8_quantizes_a_dense_checkpoint_per_channel_at_load(tiny):
    model, _ = load_model(tiny["llama"], quantization="fp8")
    ref, _ = load_model(tiny["llama"])
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, QuantizedLinear) and gate_up.weight.format_names() == ["FP8"]
    assert isinstance(model.lm_head, torch.nn.Linear) and isinstance(model.model.embed_tokens, torch.nn.Embedding)
    want = ref.model.layers[0].mlp.gate_up_proj.weight
    torch.testing.assert_close(gate_up.weight.dequantize(), want, rtol=0.07, atol=1e-6)


def test_lone_prefill_graphs_reach_further_by_default_where_weights_stay_quantized(tiny):
    """A quantized model's eager prefill is host-bound well past the 16-bit default's graph lengths, so the engine
    resolves the unset prefill_graph_tokens by the weights it loaded; a value given is kept."""
    resolved = {q: LLM(str(tiny["llama"]), quantization=q, **extra).engine.config.prefill_graph_tokens
                for q, extra in (("fp8", {}), ("none", {}), ("keep", {"prefill_graph_tokens": 64}))}
    assert resolved == {"fp8": QUANTIZED_PREFILL_GRAPH_TOKENS, "none": PREFILL_GRAPH_TOKENS, "keep": 64}


def test_quantization_is_refused_where_it_does_not_apply(tiny, tmp_path):
    gguf_path = write_gguf(tiny["qwen3"], tmp_path / "f.gguf", quant="Q8_0")
    with pytest.raises(ValueError, match="quantizes a dense checkpoint"):
        load_model(gguf_path, quantization="fp8")
    awq = write_quantized_checkpoint(json.loads((tiny["qwen3"] / "config.json").read_text()),
                                     read_tensors(tiny["qwen3"]).items(), tmp_path / "awq", "awq")
    with pytest.raises(ValueError, match=r"quantizes a dense checkpoint; .* is already quantized \(awq\)"):
        load_model(awq, quantization="fp8")
    with pytest.raises(ValueError, match="unsupported quantization 'int3'; use auto, keep, none, fp8"):
        load_model(tiny["qwen3"], quantization="int3")


@pytest.mark.slow  # the CPU dequantizes every layer per step when weights stay quantized
def test_smollm2_q4_1_served_quantized_generates_the_dequantized_paths_tokens():
    """The real Q4_1 file kept quantized (the CPU dequantizing a layer per product) against today's path, the file
    dequantized at load time: the same greedy tokens for the chat prompts of tests/test_smollm2.py."""
    from outrider.demo.smollm2 import smollm2_path

    path = smollm2_path()
    chats = [[{"role": "user", "content": "Write a Python function that reverses a string."}],
             [{"role": "system", "content": "You answer in one sentence."},
              {"role": "user", "content": "What is the capital of France?"}]]
    outputs = {}
    for quantization in ("keep", "none"):
        llm = LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=32, max_num_seqs=2,
                  quantization=quantization)
        assert isinstance(llm.engine.model.model.layers[0].mlp.gate_up_proj,
                          QuantizedLinear if quantization == "keep" else MergedLinear)
        tok = llm.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(m)) for m in chats]
        outputs[quantization] = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=8,
                                                                                            temperature=0.0))]
    assert outputs["keep"] == outputs["none"]


def test_server_serves_a_gguf_quantized_and_props_reports_the_weights_format_and_size(tiny, tmp_path):
    """The real server (--quantization keep on the CPU): /props lists the weights' formats and bytes, about the
    file's tensor bytes, and a chat completes."""
    import httpx

    from e2e_harness import ServerProcess

    path = write_gguf(tiny["qwen3"], tmp_path / "served.gguf", quant="Q8_0")
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    srv = ServerProcess(["-m", str(path), "-c", "256", "-np", "2", "--quantization", "keep"])
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as client:
            weights = client.get("/props").json()["model_weights"]
            assert weights["formats"] == {"Q8_0": 9}  # 2 layers' qkv, o, gate_up, down; the tied embedding
            assert 0.95 * tensor_bytes <= weights["bytes"] <= 1.05 * tensor_bytes
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        srv.stop()


def test_a_quantized_safetensors_weight_that_cannot_be_served_is_refused_by_name(tiny, tmp_path):
    """An AWQ q_proj beside a dense v_proj: the packed qkv cannot be served quantized, and an AWQ tensor has no
    dense form to fall back to."""
    from safetensors.torch import load_file, save_file

    src = tiny["qwen3"]
    dense = read_tensors(src)
    out = write_quantized_checkpoint(json.loads((src / "config.json").read_text()), dense.items(), tmp_path / "awq",
                                     "awq")
    stored = load_file(out / "model.safetensors")
    v = "model.layers.0.self_attn.v_proj"
    stored = {n: t for n, t in stored.items() if not n.startswith(v)} | {f"{v}.weight": dense[f"{v}.weight"]}
    save_file(stored, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.[qk]_proj.weight is stored in AWQ 4-bit \(group "
                                         r"128\) but cannot be served"):
        load_model(out, quantization="keep")


def test_speculative_decoding_on_a_quantized_target_with_its_quantized_drafter_keeps_plain_greedy_tokens(tiny,
                                                                                                        tmp_path):
    """-md draft-Q8_0.gguf on a Q5_1 target kept quantized: verify rows run the quantized products, and the greedy
    output is plain decoding's (the drafter loads by the auto rule: dequantized on the CPU, quantized on CUDA)."""
    target = write_gguf(tiny["qwen3"], tmp_path / "t.gguf", quant="Q5_1")
    draft = write_gguf(tiny["qwen3"], tmp_path / "draft-Q8_0.gguf", quant="Q8_0")
    prompts = [list(range(3, 30)), [1, 17, 99, 200, 7]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = [c.token_ids for c in LLM(str(target), quantization="keep").generate(prompts, params)]
    spec = LLM(str(target), draft_model=str(draft), spec_draft_n_max=3, quantization="keep")
    assert isinstance(spec.engine.model.model.layers[0].mlp.gate_up_proj, QuantizedLinear)
    outs = spec.generate(prompts, params)
    assert [c.token_ids for c in outs] == plain
    assert spec.engine.drafter_kind == "draft" and outs[0].timing.draft_n_accepted > 0


@pytest.mark.parametrize("fmt", ["q4_k_m", "fp8", "awq"])
def test_a_random_models_projections_become_random_quantized_ones(tiny, fmt):
    """bench spec --weights-format: the decoder projections swap for random quantized ones (Q4_K_M's mix per
    tensor), the embedding and LM head stay as they were, and the model still computes finite logits."""
    from outrider.quant.writers import quantize_projections_randomly

    model, cfg = load_model(tiny["qwen2"])
    head = model.lm_head.weight.clone()
    quantize_projections_randomly(model, json.loads((tiny["qwen2"] / "config.json").read_text()), fmt)
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear) and layer.self_attn.qkv_proj.bias is not None
        if fmt == "q4_k_m":
            want = gguf_tensor_type("q4_k_m", f"model.layers.{i}.mlp.down_proj.weight", cfg.num_hidden_layers)
            assert layer.mlp.down_proj.weight.format_names() == [want]
    assert torch.equal(model.lm_head.weight, head) and isinstance(model.model.embed_tokens, torch.nn.Embedding)
    assert torch.isfinite(model.compute_logits(torch.randn(2, cfg.hidden_size))).all()
