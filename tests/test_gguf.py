"""GGUF checkpoints on tiny models: files written as llama.cpp's converter writes them (outrider/testing/gguf.py)
load to the weights they were made from, every supported quant type dequantizes to what gguf reads, the tokenizer
equals transformers' reading of the same file, and what we cannot load is refused by name."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch

from outrider import LLM, SamplingParams, bench
from outrider.cli import SERVE_GROUPS, engine_kwargs, parse
from outrider.models import load_model, registry, resolve_model_path
from outrider.models.loader import checkpoint_layout
from outrider.models.gguf import QUANT_TYPES
from outrider.models.hub import resolve_hub_model
from outrider.speculative.kinds import detect_kind
from outrider.testing.checkpoints import write_tiny_checkpoint
from outrider.testing.gguf import RANDOM_BLOCK_TYPES, write_gguf
from outrider.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CASES = {  # name -> write_tiny_checkpoint arguments
    "llama": ("llama", {}),
    "llama3-rope-tied": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0, "tie": True}),
    "qwen2": ("qwen2", {}),
    "qwen3-tied": ("qwen3", {"tie": True, "head_dim": 32}),
    "phi3-longrope-window": ("phi3", {"extra_config": {
        "sliding_window": 7, "original_max_position_embeddings": 8,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [1.0 + 2.0 * i for i in range(8)]}}}),
    # What llama.cpp's gemma3 files imply: every sixth layer global, local RoPE base 10000, q scaled by the head
    # size. Linear RoPE scaling on the global layers, a logit softcap.
    "gemma3-softcap-linear-rope": ("gemma3", {"layers": 6, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                                              "extra_config": {"sliding_window_pattern": 6, "rope_local_base_freq":
                                                               10000.0, "final_logit_softcapping": 20.0}}),
}
# Converted as another architecture's file: (write_tiny_checkpoint arguments, the architecture the file loads as).
CONVERTED_AS = {
    "mistral": (("mistral", {}), "LlamaForCausalLM"),
}
CORPUS = [
    "Hello, world! It's 2024 and we're testing 12345 tokens; 3.14159 isn't 22/7.",
    "def reverse(s: str) -> str:\n    return s[::-1]  # slice\n\n\tif x >= 10 and y != -1:\n        pass\n",
    "naïve café, Größe, 日本語のテキスト, Привет мир, 🙂👍🏽 and \u200b zero-width",
    "   leading spaces\n\n\n  trailing   ",
    "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after a special<|im_end|><|im_end|>",
    "'s 'T 'RE 'Ve 'm 'LL 'd \r\n\r\n x",
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Factory: (checkpoint, gguf file) for a CASES name and write_gguf arguments, each written once."""
    root, checkpoints, files = tmp_path_factory.mktemp("gguf"), {}, {}

    def make(case: str, **kwargs):
        if case not in checkpoints:
            arch, ck_args = CASES[case]
            checkpoints[case] = write_tiny_checkpoint(root / case, arch, **ck_args)
        name = "-".join([case, *(f"{k}{v}" for k, v in sorted(kwargs.items()))])
        if name not in files:
            files[name] = write_gguf(checkpoints[case], root / f"{name}.gguf", **kwargs)
        return checkpoints[case], files[name]

    return make


# --- weights -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_weights_equal_the_checkpoint_the_file_was_converted_from(converted, case):
    """F32, split in parts: every parameter exactly as the HF checkpoint has it (Llama's q/k rows un-permuted),
    the same config, and RoPE frequencies as the checkpoint's (Llama 3's rule arrives as frequency factors)."""
    ck, path = converted(case, split_max_tensors=5)
    parts = re.search(r"-00001-of-(\d{5})\.gguf$", path.name)
    assert parts and int(parts[1]) > 1
    ours, cfg = load_model(path)
    ref, ref_cfg = load_model(ck)
    assert cfg.architecture == ref_cfg.architecture and cfg.tie_word_embeddings == ref_cfg.tie_word_embeddings
    assert (cfg.vocab_size, cfg.head_dim, cfg.num_key_value_heads) == (ref_cfg.vocab_size, ref_cfg.head_dim,
                                                                        ref_cfg.num_key_value_heads)
    assert (cfg.layer_types, cfg.sliding_window) == (ref_cfg.layer_types, ref_cfg.sliding_window)
    assert ours.model.layers[0].self_attn.scale == pytest.approx(ref.model.layers[0].self_attn.scale)
    assert ours.compute_logits(torch.ones(1, cfg.hidden_size)).equal(ref.compute_logits(torch.ones(1,
                                                                                                 cfg.hidden_size)))
    got, want = ours.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    torch.testing.assert_close(ours.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)


@pytest.mark.parametrize("quant", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_weights_load_as_gguf_dequantizes_them(converted, quant):
    """Dequantized at load time (--quantization none), each weight is dequantize(quantize(w)) of the checkpoint's
    (quantized per row, so Llama's row permutation does not change it), in the serving dtype asked for."""
    ck, path = converted("llama", quant=quant)
    ours, _ = load_model(path, dtype="bfloat16", quantization="none")
    ref, _ = load_model(ck)
    qtype = gguf.GGMLQuantizationType[quant]
    for (name, p), (_, w) in zip(ours.named_parameters(), ref.named_parameters()):
        assert p.dtype == torch.bfloat16
        if w.dim() == 1:  # norms stay F32 in the file
            want = w
        elif quant == "F16":
            want = w.half().float()
        else:
            want = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype))
        assert torch.equal(p, want.reshape(w.shape).to(torch.bfloat16)), name


@pytest.mark.parametrize("quant", RANDOM_BLOCK_TYPES)
def test_k_quants_load_as_gguf_dequantizes_them(tmp_path, quant):
    """K-quants (256-value blocks; gguf cannot quantize them in Python, so the blocks are random): each weight is
    what gguf dequantizes from the file's bytes (dequantized at load time)."""
    ck = write_tiny_checkpoint(tmp_path / "ck", "qwen3", hidden_size=256, layers=1, heads=2, kv_heads=1)
    path = write_gguf(ck, tmp_path / f"{quant}.gguf", quant=quant)
    ours, _ = load_model(path, quantization="none")
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, 1)
    params = dict(ours.named_parameters())
    for hf_name, slot in checkpoint_layout(ours).items():
        t = stored[names.get_name(hf_name, try_suffixes=(".weight",))]
        assert t.tensor_type.name == (quant if len(slot.shape) == 2 else "F32")
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(slot.shape)
        assert torch.equal(params[slot.param][slot.row:slot.row + slot.shape[0]], want), hf_name


@pytest.mark.parametrize("case", ["mistral"])
def test_a_file_converted_as_another_architecture_loads_as_it(tmp_path, case):
    """Mistral files are `llama` files (llama.cpp's converter; no window): the weights as the checkpoint's."""
    (arch, ck_args), loads_as = CONVERTED_AS[case]
    ck = write_tiny_checkpoint(tmp_path / case, arch, **ck_args)
    ours, cfg = load_model(write_gguf(ck, tmp_path / f"{case}.gguf"))
    ref, _ = load_model(ck)
    assert cfg.architecture == loads_as
    got, want = ours.state_dict(), ref.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("case", ["qwen3-tied", "phi3-longrope-window", "gemma3-softcap-linear-rope"])
def test_greedy_generation_matches_the_checkpoint(converted, case):
    """Through the engine (tokens, KV cache, sampler): the file generates what its checkpoint generates."""
    ck, path = converted(case, quant="F32")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[1, 17, 99, 200, 7], list(range(30, 53))]
    want = [c.token_ids for c in LLM(str(ck)).generate(prompts, params)]
    assert [c.token_ids for c in LLM(str(path)).generate(prompts, params)] == want


def test_the_log_says_the_weights_formats_and_their_memory_against_the_file(converted, caplog):
    """Kept quantized, the weights take about the file's bytes; dequantized (on the CPU by default), float32's."""
    _, path = converted("qwen2", quant="Q4_1")
    for quantization, kinds in (("keep", r"Q4_1 \(10\)"), ("auto", r"float32 \(10\)")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="outrider.models"):
            model, _ = load_model(path, quantization=quantization)
        line = next(r.getMessage() for r in caplog.records if "MiB in memory" in r.getMessage())
        m = re.search(kinds + r": ([\d.]+) MiB in memory \(([\d.]+) MiB in the file\)", line)
        assert m, line
        memory, tensors = float(m[1]), float(m[2])
        assert (memory <= 1.05 * tensors) if quantization == "keep" else (memory > 4 * tensors)


# --- refusals ----------------------------------------------------------------------------------------------------

def test_unsupported_architecture_is_refused_by_name(converted, tmp_path):
    ck, _ = converted("qwen3-tied")
    path = write_gguf(ck, tmp_path / "g.gguf", arch="gemma2")
    supported = ", ".join(sorted(n for a in registry.architectures() for n in a.gguf_names))
    assert "llama, phi3, qwen2, qwen3" in supported
    with pytest.raises(ValueError, match=f"GGUF architecture 'gemma2'; supported: {supported} "):
        load_model(path)


def test_unsupported_quant_type_is_refused_by_name_before_loading(converted, tmp_path):
    ck, _ = converted("llama")
    path = write_gguf(ck, tmp_path / "mx.gguf", quant="MXFP4")
    with pytest.raises(ValueError, match=r"quant types outrider cannot load: MXFP4 \(\d+ tensors\)"):
        load_model(path)
    assert "MXFP4" not in QUANT_TYPES


def test_unsupported_tokenizers_are_refused_by_name(converted, tmp_path):
    ck, _ = converted("llama")
    with pytest.raises(ValueError, match="GGUF tokenizer model 'llama'"):
        Tokenizer.from_pretrained(write_gguf(ck, tmp_path / "spm.gguf", tokenizer_model="llama"))
    with pytest.raises(ValueError, match="GGUF pre-tokenizer 'jais'"):
        Tokenizer.from_pretrained(write_gguf(ck, tmp_path / "jais.gguf", pre="jais"))


# --- finding the file --------------------------------------------------------------------------------------------

def test_a_directory_or_any_part_resolves_to_the_first_part(converted, tmp_path):
    _, path = converted("qwen2", split_max_tensors=5)
    folder = tmp_path / "model"
    folder.mkdir()
    parts = sorted(path.parent.glob(path.name.replace("00001", "0000?")))
    for part in parts:
        shutil.copy(part, folder)
    first = folder / path.name
    assert resolve_model_path(folder) == first
    assert resolve_model_path(folder / parts[-1].name) == first
    (folder / parts[1].name).unlink()
    with pytest.raises(ValueError, match=f"missing {parts[1].name}"):
        load_model(folder)
    shutil.copy(parts[1], folder)
    shutil.copy(parts[0], folder / "other.gguf")
    with pytest.raises(ValueError, match="several GGUF models"):
        resolve_model_path(folder)


def _fake_hub_cache(root, repo: str, files: dict) -> None:
    """The huggingface_hub cache layout: refs/main names a snapshot holding the files."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text("0" * 40)
    snapshot = repo_dir / "snapshots" / ("0" * 40)
    for name, source in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, snapshot / name)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_hf_repo_quant_tag_picks_that_gguf_from_the_cache(converted, hub_cache):
    ck, q8 = converted("qwen3-tied", quant="Q8_0")
    _, q4 = converted("qwen3-tied", quant="Q4_0")
    _fake_hub_cache(hub_cache, "someone/tiny-GGUF", {"tiny-Q8_0.gguf": q8, "tiny-Q4_K_M.gguf": q4,
                                                     "mmproj-tiny-Q8_0.gguf": q8, "README.md": ck / "config.json"})
    assert resolve_hub_model("someone/tiny-GGUF:q8_0", offline=True).name == "tiny-Q8_0.gguf"
    assert resolve_hub_model("someone/tiny-GGUF", offline=True).name == "tiny-Q4_K_M.gguf"  # the default tag
    assert resolve_hub_model("someone/tiny-GGUF", offline=True, filename="tiny-Q8_0.gguf").name == "tiny-Q8_0.gguf"
    with pytest.raises(ValueError, match=r"no GGUF file for quant 'Q6_K' \(it has tiny-Q4_K_M.gguf, tiny-Q8_0.gguf\)"):
        resolve_hub_model("someone/tiny-GGUF:Q6_K", offline=True)
    with pytest.raises(ValueError, match="cannot find model 'someone/absent'.*not in the local hub cache"):
        resolve_hub_model("someone/absent:Q8_0", offline=True)
    # The server's flags: -hf with the tag (and --offline) load the file, under the repo's name.
    ns = parse(SERVE_GROUPS, ["-hf", "someone/tiny-GGUF:Q8_0", "--offline"])
    assert engine_kwargs(ns)["model"].endswith("snapshots/" + "0" * 40 + "/tiny-Q8_0.gguf")


def test_hf_repo_split_gguf_and_safetensors_repos_from_the_cache(converted, hub_cache):
    ck, path = converted("llama", split_max_tensors=5)
    parts = sorted(path.parent.glob(path.name.replace("00001", "0000?")))
    _fake_hub_cache(hub_cache, "someone/split", {f"Q8_0/{p.name}": p for p in parts})
    got = resolve_hub_model("someone/split:Q8_0", offline=True)
    assert got.name == path.name and load_model(got)[1].architecture == "LlamaForCausalLM"
    _fake_hub_cache(hub_cache, "someone/split-missing", {f"Q8_0/{p.name}": p for p in parts[:-1]})
    with pytest.raises(ValueError, match=f"{parts[-1].name} not found in the local hub cache"):
        resolve_hub_model("someone/split-missing", offline=True)
    _fake_hub_cache(hub_cache, "someone/plain", {p.name: p for p in ck.iterdir()})
    assert (resolve_hub_model("someone/plain", offline=True) / "config.json").is_file()
    with pytest.raises(ValueError, match="someone/plain has no GGUF file for quant 'Q4_0' \\(it has no GGUF files\\)"):
        resolve_hub_model("someone/plain:Q4_0", offline=True)


def test_a_gguf_draft_model_drafts_for_the_target(converted):
    """-md file.gguf: a draft model; the target's own weights as a GGUF draft are accepted every time."""
    ck, path = converted("qwen3-tied")
    assert detect_kind(str(path), str(ck)) == "draft"
    llm = LLM(str(ck), draft_model=str(path), spec_draft_n_max=3)
    out = llm.generate([list(range(3, 30))], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert llm.engine.drafter_kind == "draft"
    assert out.timing.draft_rounds > 0 and out.timing.draft_n_accepted == out.timing.draft_n


# --- tokenizer ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_tokenizer_equals_transformers_reading_of_the_file(converted, pre):
    transformers = pytest.importorskip("transformers")
    _, path = converted("llama", pre=pre)
    ours = Tokenizer.from_pretrained(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in CORPUS:
        assert ours.encode(text, add_special=False) == theirs(text, add_special_tokens=False)["input_ids"], text
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.vocab_size == len(theirs)


def test_smollm_pre_tokenizer_splits_digits_one_by_one(converted):
    """llama.cpp's `smollm` splits every digit apart before merging; `gpt2` lets the merges join them."""
    _, smollm = converted("llama", pre="smollm")
    _, gpt2 = converted("llama", pre="gpt2")
    by_digit, merged = Tokenizer.from_pretrained(smollm), Tokenizer.from_pretrained(gpt2)
    text = "x = 100000 + 2024"
    assert len(merged.encode(text, add_special=False)) < len(by_digit.encode(text, add_special=False))
    assert by_digit.encode("100000", add_special=False) == [by_digit.encode(d, add_special=False)[0]
                                                            for d in "100000"]
    assert by_digit.decode(by_digit.encode(text, add_special=False)) == text


def test_special_ids_bos_and_chat_template_come_from_the_metadata(converted):
    ck, path = converted("qwen2")
    ours, ref = Tokenizer.from_pretrained(path), Tokenizer.from_pretrained(ck)
    assert ours.chat_template == ref.chat_template and ours.chat_template
    assert (ours.bos_token_id, ours.eos_token_ids, ours.add_bos) == (ref.bos_token_id, ref.eos_token_ids, ref.add_bos)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages)
    assert ours.encode(ours.apply_chat_template(messages)) == ref.encode(ref.apply_chat_template(messages))


def test_benchmarks_take_a_gguf_model(converted, tmp_path, capsys):
    """`outrider bench latency|throughput --model file.gguf` (engine_setup's path, shared by every bench)."""
    _, path = converted("qwen3-tied", quant="Q8_0")
    out = tmp_path / "latency.json"
    assert bench.main(["latency", "--model", str(path), "--device", "cpu", "--prompt-len", "8", "--gen", "4",
                       "--ttft-prompt-len", "0", "--json", str(out)]) == 0
    row = next(r for r in json.loads(out.read_text()) if r["label"].startswith("latency"))
    assert row["tok_s"] > 0 and path.name in capsys.readouterr().out
    assert bench.main(["throughput", "--model", str(path), "--device", "cpu", "--num-requests", "3",
                       "--min-len", "4", "--max-len", "8", "--max-num-seqs", "2"]) == 0
    assert "throughput" in capsys.readouterr().out
