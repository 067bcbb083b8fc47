"""The demo trainer (outrider_tools.demo) end to end on the CPU with tiny sizes (--smoke), its formats against HF
transformers, and its training-mode forward of outrider's modules against the paged serving forward."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from outrider_tools import dense
from outrider_tools.demo import corpus, models, objectives, profiles, proxy, tokenizer, train, training
from outrider_tools.pack import pack

ROOT = Path(__file__).resolve().parents[1]

MTP_MODULE_TENSORS = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                      "mtp.norm.weight"}
LAYER_TENSORS = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"}


def run_smoke(out: Path, seed: int = 0, pack: Path | None = None, extra: tuple[str, ...] = ()) -> dict:
    subprocess.run([sys.executable, "-m", "outrider_tools.demo.train", "--smoke", "--device", "cpu", "--seed", str(seed),
                    "--out", str(out), *(["--pack", str(pack)] if pack else []), *extra],
                   check=True, cwd=ROOT, timeout=300, capture_output=True)
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return tmp_path_factory.mktemp("demo-pack")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, packed):
    out = tmp_path_factory.mktemp("demo-smoke")
    return out, run_smoke(out, pack=packed)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_smoke_writes_every_artifact(smoke):
    out, metrics = smoke
    for d in ("target", "draft"):
        for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json"):
            assert (out / d / f).is_file(), f"{d}/{f}"
    for d in ("dflash", "eagle3"):
        assert (out / d / "config.json").is_file() and (out / d / "model.safetensors").is_file(), d
    prompts = json.loads((out / "eval_prompts.json").read_text())
    assert prompts and {p["kind"] for p in prompts} <= {"def", "window"}
    t = metrics["target"]
    assert t["held_out_loss"] > 0 and t["unigram_loss"] > 0 and t["held_out_bits_per_byte"] > 0
    assert t["steps_run"] == t["steps_planned"] and not t["stopped_by_time"]
    e = metrics["eagle3"]
    assert e["steps_run"] == profiles.SMOKE.eagle3_train[0] and not e["stopped_by_time"]
    assert e["draft_vocab_size"] == profiles.SMOKE.eagle3_vocab and 0 < e["draft_vocab_covers"]["generated"] <= 1
    assert {f"eagle3_k{k}" for k in range(1, profiles.SMOKE.eagle3_steps + 1)} <= set(metrics["acceptance_proxy"]["all"])
    assert metrics["corpus"]["held_out_files"] > 0 and metrics["corpus"]["train_files"] > 0
    assert metrics["corpus"]["method_chat_examples"] > 0
    packages = metrics["corpus"]["packages"]  # by default the running interpreter's site-packages
    assert packages["roots"] == [str(r) for r in corpus.site_dirs()] and packages["roots"]
    assert 0 < packages["bytes"] <= packages["cap_bytes"] and packages["files"] > 0
    for name, r in metrics["acceptance_proxy"]["all"].items():
        assert r["steps"] == 0 or 1 <= r["mean_tau"], name
    assert 0 <= metrics["acceptance_proxy"]["greedy_repeated_share"] <= 1
    assert [x["prompt"] for x in metrics["samples"]] == list(train.SAMPLE_PROMPTS)
    assert all(x["completion"] for x in metrics["samples"])
    log = (out / "train_log.txt").read_text()
    assert "target held-out loss" in log and "acceptance proxy" in log


def test_pack_is_what_a_device_run_returns_and_unpacks_into_the_family(smoke, packed, tmp_path):
    """At most 8 files of at most 16 MiB each; the tar parts unpack into the layout of outrider/demo."""
    out, _ = smoke
    files = sorted(f.name for f in packed.iterdir())
    assert files == sorted([*train.PACK_PARTS, "metrics.json", "train_log.txt"]) and len(files) <= 8
    assert all(f.stat().st_size <= 16 << 20 for f in packed.iterdir())
    for part in train.PACK_PARTS:
        with tarfile.open(packed / part) as tar:
            tar.extractall(tmp_path, filter="data")
    shipped = {f.relative_to(out) for f in out.rglob("*") if f.is_file()}
    unpacked = {f.relative_to(tmp_path) for f in tmp_path.rglob("*") if f.is_file()}
    assert unpacked == shipped
    for rel in unpacked - {Path("train_log.txt")}:  # the log goes on after packing (the "packed" lines)
        assert (tmp_path / rel).read_bytes() == (out / rel).read_bytes(), rel
    models = pytest.importorskip("outrider.models")
    _, cfg = models.load_model(str(tmp_path / "target"), dtype="float32", device="cpu")
    assert cfg.mtp_num_hidden_layers == 1


def test_left_padded_batch_generation_equals_one_prompt_at_a_time():
    torch.manual_seed(0)
    model = models.new_lm(profiles.Shape(64, 2, 2, 1, 32, 128), 96)
    models.init_weights(model.model, std=0.3)  # peaked logits: greedy choices are not near-ties
    ctx = training.Ctx(torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (3, 9, 5, 12)]
    batched = training.greedy_continuations(model, prompts, 20, ctx, "cpu")
    for prompt, got in zip(prompts, batched):
        alone = training.generate(model, torch.tensor([prompt]), 20, ctx)[0].tolist()
        assert got == alone[:len(got)] and (len(got) == 20 or got[-1] in tokenizer.EOS_IDS)


def test_learning_rate_warms_up_then_decays_to_zero():
    assert training.lr_at(0, 0.0, 1.0, 10) == pytest.approx(0.1)
    assert training.lr_at(9, 0.009, 1.0, 10) == pytest.approx(0.991)
    assert training.lr_at(500, 0.5, 1.0, 10) == pytest.approx(0.5)
    assert training.lr_at(999, 1.0, 1.0, 10) == 0.0


def test_a_stage_that_reaches_its_time_cap_ends_its_schedule_there(monkeypatch):
    """Time progress drives the learning-rate decay when it runs ahead of step progress: a slow device gets fewer
    steps with the whole schedule, not a schedule cut off at full learning rate."""
    layer = torch.nn.Linear(4, 1)
    progress = []
    real_lr_at = training.lr_at
    monkeypatch.setattr(training, "lr_at", lambda step, p, lr, warmup: progress.append(p) or real_lr_at(step, p, lr,
                                                                                                   warmup))

    def loss_fn(step):
        time.sleep(0.01)
        return layer(torch.ones(2, 4)).pow(2).mean()

    res = training.train_loop("t", layer, list(layer.parameters()), 10_000, 1e-2, 2, loss_fn,
                        lambda: {"val": layer.weight.abs().sum().item()}, 5, training.Ctx(torch.device("cpu")),
                        max_seconds=0.1)
    assert res["stopped_by_time"] and 2 <= res["steps_run"] < 100 and len(progress) == res["steps_run"]
    # Each step sleeps 10 ms of the 100: from the second step on, time's progress is >= 0.1, where step progress
    # alone would be below 0.01 (a busy machine runs fewer, slower steps; the bound holds)
    assert progress == sorted(progress) and progress[-1] >= 0.1
    assert res["history"][-1]["step"] == res["steps_run"]  # the last step is evaluated


def test_chat_examples_ask_for_functions_and_methods():
    source = textwrap.dedent('''\
        def add(a, b):
            """Return the sum of a and b."""
            return a + b


        class Stack:
            def push(self, item):
                """Put item on top of the stack."""
                self.items.append(item)

            def _hidden(self):
                """Not asked for: private."""
        ''')
    (function,) = corpus.chat_examples([("m.py", source)], 10, 0)
    assert function.startswith("<|im_start|>user\nWrite a Python function `add(a, b)`: Return the sum of a and b."
                               "<|im_end|>\n<|im_start|>assistant\n```python\ndef add(a, b):")
    (method,) = corpus.chat_examples([("m.py", source)], 10, 0, methods=True)
    assert "Write the method `Stack.push(self, item)`: Put item on top of the stack." in method
    code = method.split("```python\n", 1)[1].rsplit("```", 1)[0]
    assert code.startswith("def push(self, item):\n    ") and ast.parse(code)


def test_repeated_tokens_counts_ngrams_seen_before():
    loop = [1, 2, 3] * 5
    assert proxy.repeated_tokens(loop, 3, n=3) == 10  # indices 5..14 end a 3-gram seen before; 3 and 4 do not
    assert proxy.repeated_tokens(list(range(20)), 5, n=3) == 0


def test_smoke_checkpoints_load_in_transformers_and_the_training_forward_matches_it(smoke):
    """What trains (outrider's modules run densely) computes what transformers computes from the written files."""
    transformers = pytest.importorskip("transformers")
    out, _ = smoke
    for kind, shape in (("target", profiles.SMOKE.target), ("draft", profiles.SMOKE.draft)):
        cfg = json.loads((out / kind / "config.json").read_text())
        assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
        hf = transformers.AutoModelForCausalLM.from_pretrained(out / kind, dtype=torch.float32).eval()
        ours = models.load_lm(out / kind)
        assert profiles.Shape.of(ours.config) == shape
        x = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = hf(x).logits
            h, _ = ours(x)
            got = ours.logits(h)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_smoke_mtp_and_dflash_formats(smoke):
    out, _ = smoke
    cfg = json.loads((out / "target" / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1
    t = tensors(out / "target")
    mtp = {k for k in t if k.startswith("mtp.")}
    assert mtp == MTP_MODULE_TENSORS | {f"mtp.layers.0.{n}" for n in LAYER_TENSORS}
    H = cfg["hidden_size"]
    assert t["mtp.fc.weight"].shape == (H, 2 * H)
    for n in LAYER_TENSORS:  # the MTP layer has the shape of a target layer
        assert t[f"mtp.layers.0.{n}"].shape == t[f"model.layers.0.{n}"].shape, n
    assert all(v.dtype == torch.bfloat16 for v in t.values())

    d = json.loads((out / "dflash" / "config.json").read_text())
    assert d["architectures"] == ["DFlashDraftModel"]
    assert d["hidden_size"] == H and d["num_target_layers"] == cfg["num_hidden_layers"]
    taps = d["dflash_config"]["target_layer_ids"]
    assert all(0 <= i < cfg["num_hidden_layers"] for i in taps)
    tok = json.loads((out / "target" / "tokenizer.json").read_text())
    mask_ids = [a["id"] for a in tok["added_tokens"] if a["content"] == "<|mask|>"]
    assert mask_ids == [d["dflash_config"]["mask_token_id"]] and d["block_size"] >= 2
    ft = tensors(out / "dflash")
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}" for i in range(d["num_hidden_layers"]) for n in LAYER_TENSORS}
    assert set(ft) == expected
    assert ft["fc.weight"].shape == (H, len(taps) * H)
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in ft)
    assert tokenizer.MASK_ID == d["dflash_config"]["mask_token_id"]


def test_smoke_tokenizer_specials_and_chat_template(smoke):
    transformers = pytest.importorskip("transformers")
    out, _ = smoke
    tok = transformers.AutoTokenizer.from_pretrained(out / "target")
    ids = tok("def f(x):").input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<|endoftext|>")  # BOS = the document separator
    assert tok.decode(ids[1:]) == "def f(x):"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((out / "target" / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == {tok.convert_tokens_to_ids("<|endoftext|>"),
                                        tok.convert_tokens_to_ids("<|im_end|>")}


def test_dflash_block_mask_semantics():
    ids = torch.arange(20)[None] + 10
    anchors = torch.tensor([[3, 9]])
    block_ids, pos, mask = objectives.dflash_block(ids, anchors, 4)
    assert block_ids.tolist() == [[13, tokenizer.MASK_ID, tokenizer.MASK_ID, tokenizer.MASK_ID, 19, tokenizer.MASK_ID, tokenizer.MASK_ID, tokenizer.MASK_ID]]
    assert pos.tolist() == [[3, 4, 5, 6, 9, 10, 11, 12]]
    m = mask[0, 0]
    assert m.shape == (8, 20 + 8)
    assert m[0, :20].tolist() == [True] * 3 + [False] * 17  # context strictly before the anchor
    assert m[5, :20].tolist() == [True] * 9 + [False] * 11
    assert m[1, 20:].tolist() == [True] * 4 + [False] * 4  # its own block, bidirectionally
    assert m[7, 20:].tolist() == [False] * 4 + [True] * 4


@torch.no_grad()
def test_mtp_training_chain_is_outriders_serving_chain():
    """The MTP chain as it trains (dense, teacher-forced over a whole sequence) gives, at every index i and step k,
    what outrider's QwenMTP gives served over its paged KV cache: step 1 over committed pairs (causal), steps 2..k
    one token each at position i + k - 1 over the cached keys and the chain's own."""
    from outrider.attention import KVCache, get_backend
    from outrider.attention.metadata import build_metadata

    torch.manual_seed(0)
    target = models.new_lm(profiles.Shape(32, 1, 2, 1, 16, 64), 64)
    mtp = models.new_mtp(target.config)
    target.model.eval()
    mtp.eval()
    ids = torch.randint(0, 64, (1, 12))
    steps, block = 3, 4
    h, _ = target(ids)
    outs = dense.mtp_unroll(mtp, target, h, ids, steps)
    backend, blocks, cfg = get_backend("cpu"), list(range(8)), target.config
    for i in range(ids.shape[1] - 1 - steps):
        kv = KVCache.allocate(1, 8, block, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
        meta, positions = build_metadata([(blocks, 0, i + 1)], block, "cpu")  # pairs j = 0..i at positions 0..i
        y = mtp(target.embed(ids[0, 1:i + 2]), h[0, :i + 1], positions, target.model.model.rotary_emb, kv, meta,
                backend)[-1:]
        torch.testing.assert_close(y[0], outs[0][0, i], atol=1e-5, rtol=1e-5)
        for k in range(2, steps + 1):
            meta, positions = build_metadata([(blocks, i + k - 1, 1)], block, "cpu")
            y = mtp(target.embed(ids[0, i + k:i + k + 1]), y, positions, target.model.model.rotary_emb, kv, meta,
                    backend)
            torch.testing.assert_close(y[0], outs[k - 1][0, i], atol=1e-5, rtol=1e-5)


def test_walk_counts_acceptance_lengths():
    # positions 0..9, start at 2, k = 2: step at 2 accepts 2 (tau 3) -> n = 5; at 5 accepts 0 (tau 1) -> n = 6;
    # at 6 accepts 1 (tau 2) -> n = 8 = end - k + 1 ... 8 + 2 > 9 stops
    m = [[False, False] for _ in range(10)]
    m[2] = [True, True]
    m[6] = [True, False]
    assert proxy.walk(m, 2, 9, 2) == [3, 1, 2]


@pytest.mark.slow
def test_smoke_is_reproducible(smoke, tmp_path):
    _, first = smoke
    again = run_smoke(tmp_path)
    assert again["target"]["held_out_loss"] == first["target"]["held_out_loss"]
    assert again["corpus"]["sha256"] == first["corpus"]["sha256"]
    assert again["acceptance_proxy"]["all"] == first["acceptance_proxy"]["all"]


def write_files(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def module_text(name: str, n: int) -> str:
    """A distinct, plausible module of about n functions."""
    return "".join(f"def {name}_function_number_{i}(argument_value):\n    return argument_value * {i} + {len(name)}\n\n"
                   for i in range(n))


def test_package_files_are_taken_in_a_fixed_order_up_to_the_cap(tmp_path):
    names = [f"pkg{i % 3}/mod{i}.py" for i in range(24)]
    texts = {rel: module_text(f"m{i}", 5 + i % 4) for i, rel in enumerate(names)}
    first = write_files(tmp_path / "a" / "site-packages", texts)
    # the same files, created in the opposite order
    second = write_files(tmp_path / "b" / "site-packages", dict(reversed(list(texts.items()))))
    cap = sum(len(t) for t in texts.values()) // 2
    got = corpus.package_files([first], [], cap, 1_000_000)
    assert got.files == corpus.package_files([second], [], cap, 1_000_000).files
    taken = sum(len(t.encode()) for _, t in got.files)
    assert taken <= cap and 0 < len(got.files) < len(texts)
    by_hash = sorted(texts, key=lambda rel: hashlib.sha1(rel.encode()).digest())
    assert [rel for rel, _ in got.files] == [f"0:{rel}" for rel in by_hash[:len(got.files)]]
    assert taken + len(texts[by_hash[len(got.files)]]) > cap  # it stopped at the first file over the cap
    assert len(corpus.package_files([first], [], 10 ** 9, 1_000_000).files) == len(texts)


def test_package_files_leave_out_duplicates_stdlib_copies_and_generated_files(tmp_path):
    stdlib_module = module_text("stdlib", 12)
    root = write_files(tmp_path / "site-packages", {
        "same_as_stdlib.py": stdlib_module,
        "backport/__init__.py": stdlib_module + module_text("extra", 3),  # 12 of 15 long lines from the stdlib
        "twice/a.py": module_text("twice", 4),
        "twice/b.py": module_text("twice", 4),
        "table.py": "TABLE = " + repr("x" * 2000) + "\n",
        "own.py": module_text("own", 6),
        "borrows_a_little.py": module_text("own2", 6) + stdlib_module.split("\n\n")[0] + "\n",
    })
    got = corpus.package_files([root], [("stdmod.py", stdlib_module)], 10 ** 9, 1_000_000)
    names = {rel.split(":", 1)[1] for rel, _ in got.files}
    assert names == {"own.py", "borrows_a_little.py"} | ({"twice/a.py", "twice/b.py"} & names)
    assert len(names & {"twice/a.py", "twice/b.py"}) == 1
    assert (got.skipped_duplicates, got.skipped_stdlib_copies, got.skipped_generated) == (2, 1, 1)


def test_package_files_change_neither_the_held_out_stream_nor_the_tokenizer(tmp_path):
    """The held-out loss of a family trained with packages compares with one trained without: the same held-out
    tokens under the same tokenizer."""
    stdlib = write_files(tmp_path / "stdlib", {f"lib{i}/mod{i}.py": module_text(f"lib{i}", 3 + i % 5)
                                               for i in range(60)})
    packages = write_files(tmp_path / "site-packages", {f"p/m{i}.py": module_text(f"pkg{i}", 4) for i in range(10)})
    profile = dataclasses.replace(profiles.SMOKE, vocab=300)
    without = corpus.build_corpus(stdlib, [], profile, 0)
    with_packages = corpus.build_corpus(stdlib, [packages], profile, 0)
    assert without.held_files and not without.packages.files and len(with_packages.packages.files) == 10
    assert with_packages.held_files == without.held_files
    assert with_packages.tok.to_str() == without.tok.to_str()
    assert torch.equal(with_packages.val_stream, without.val_stream)
    extra = sum(len(t) for _, t in with_packages.packages.files)
    assert len(with_packages.train_stream) > len(without.train_stream) + extra // 20
    summary = with_packages.summary()
    assert summary["sha256"] == without.summary()["sha256"]  # the stdlib's fingerprint
    assert summary["packages"]["files"] == 10 and summary["packages"]["roots"] == [str(packages)]
    assert summary["packages"]["sha256"] != without.summary()["packages"]["sha256"]


def test_pack_of_an_unfinished_run_holds_the_stages_written_so_far(tmp_path):
    """--pack runs after every stage: a run stopped from outside still returns the target and its metrics."""
    out = write_files(tmp_path / "out", {"target/config.json": "{}", "metrics.json": "{\"stage\": 1}",
                                         "train_log.txt": "target done\n"})
    dest = tmp_path / "pack"
    pack(out, dest, train.PACK_PARTS)
    assert sorted(f.name for f in dest.iterdir()) == ["demo-drafters.tar", "demo-target.tar", "metrics.json",
                                                      "train_log.txt"]
    with tarfile.open(dest / "demo-drafters.tar") as tar:
        assert sorted(tar.getnames()) == ["metrics.json", "train_log.txt"]
    write_files(out, {"draft/config.json": "{}", "metrics.json": "{\"stage\": 2}"})
    pack(out, dest, train.PACK_PARTS)
    with tarfile.open(dest / "demo-drafters.tar") as tar:
        assert "draft/config.json" in tar.getnames()
    assert (dest / "metrics.json").read_text() == "{\"stage\": 2}"
    assert sorted(f.name for f in dest.iterdir()) == ["demo-drafters.tar", "demo-target.tar", "metrics.json",
                                                      "train_log.txt"]


EAGLE3_LAYER_TENSORS = {"input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}


def test_smoke_eagle3_checkpoint_is_in_the_eagle_reference_layout(smoke):
    """LlamaForCausalLMEagle3: fc over three taps, one Llama layer (no q/k norm) under midlayer. reading 2H, norm,
    an lm_head over the draft vocabulary, d2t/t2d naming the most frequent target tokens; no embedding."""
    out, _ = smoke
    target = json.loads((out / "target" / "config.json").read_text())
    cfg = json.loads((out / "eagle3" / "config.json").read_text())
    H, V, Vd = target["hidden_size"], target["vocab_size"], profiles.SMOKE.eagle3_vocab
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == Vd
    assert cfg["vocab_size"] == V and cfg["hidden_size"] == cfg["target_hidden_size"] == H
    taps = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]  # layer inputs: output of block j - 1
    assert taps == [t + 1 for t in profiles.SMOKE.eagle3_taps] and max(taps) <= target["num_hidden_layers"] - 1
    t = tensors(out / "eagle3")
    assert set(t) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{n}" for n in EAGLE3_LAYER_TENSORS}
    assert t["fc.weight"].shape == (H, 3 * H) and t["lm_head.weight"].shape == (Vd, H)
    assert t["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert all(v.dtype == torch.bfloat16 for k, v in t.items() if k not in ("d2t", "t2d"))
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and t["t2d"].shape == (V,)
    ids = torch.arange(Vd) + t["d2t"]
    assert ids.tolist() == sorted(set(ids.tolist())) and t["t2d"].nonzero().flatten().tolist() == ids.tolist()
    assert tokenizer.EOT_ID in ids.tolist()  # the document separator is one of the most frequent tokens


def test_draft_vocabulary_takes_the_most_frequent_tokens_of_both_streams_equally():
    corpus = torch.tensor([5] * 50 + [6] * 30 + [7] * 20)
    generated = torch.tensor([8] * 7 + [7] * 2 + [6])  # shares: 5 0.5, 8 0.7, 7 0.2 + 0.2, 6 0.3 + 0.1
    assert objectives.draft_vocabulary([corpus, generated], 10, 2).tolist() == [5, 8]
    assert objectives.draft_vocabulary([corpus], 10, 2).tolist() == [5, 6]
    assert objectives.draft_vocabulary([torch.tensor([3, 1])], 10, 2).tolist() == [1, 3]  # ties: the lower ids
    assert objectives.draft_vocabulary([torch.tensor([3, 1])], 10, 3).tolist() == [0, 1, 3]


@torch.no_grad()
def test_smoke_eagle3_head_served_gives_the_logits_it_trains_on_along_the_chain(smoke):
    """outrider's EAGLE-3 loader and modules run as the chain drafter runs them (paged KV) give the logits the
    trainer computes (eagle3_outputs, the same modules run densely) for the smoke head: the taps (fc's input, in layer order), step 1 over committed
    pairs (causal, from fc(taps)) and the chained steps at index i (position i + k - 1, over step 1's keys up to i
    and the chain's own). The teacher of step k at index i is the target at index i + k."""
    from outrider.attention import KVCache, get_backend
    from outrider.attention.metadata import build_metadata
    from outrider.models import registry
    from outrider.layers.rotary import RotaryEmbedding
    from outrider.models import load_model
    from outrider.speculative.eagle3 import load_eagle3

    out, _ = smoke
    target, tcfg = load_model(str(out / "target"), dtype="float32", device="cpu")
    head, cfg, taps = load_eagle3(str(out / "eagle3"), registry.load_config(out / "target"))
    head = head.float()
    ours_target = models.load_lm(out / "target")
    ours = models.load_eagle3_head(out / "eagle3", ours_target.config)
    our_taps = ours.taps
    assert taps == our_taps == profiles.SMOKE.eagle3_taps
    assert torch.equal(torch.arange(len(head.d2t)) + head.d2t, ours.draft_ids())

    steps, T, block = 3, 20, 4
    ids = torch.randint(4, tcfg.vocab_size, (T,), generator=torch.Generator().manual_seed(0))
    trained = objectives.eagle3_outputs(ours, ours_target, ids[None], our_taps, steps)

    backend, blocks = get_backend("cpu"), list(range(16))
    rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    def metadata(start, count):  # one sequence: `count` queries after `start` cached positions
        return build_metadata([(blocks, start, count)], block, "cpu")

    kv = KVCache.allocate(tcfg.num_hidden_layers, 16, block, tcfg.num_key_value_heads, tcfg.head_dim, torch.float32,
                          "cpu")
    meta, positions = metadata(0, T)
    out = target(ids, positions, kv, meta, backend, taps)
    target_logits = target.compute_logits(out.hidden)
    ctx = head.fc(out.aux_hidden)

    def logits(y):
        return head.lm_head(head.norm(y)).float()

    N = T - 1 - steps
    for k, (_, on_vocab, best) in enumerate(trained, start=1):
        torch.testing.assert_close(on_vocab[0], target_logits[k:k + N, ours.draft_ids()], atol=1e-3, rtol=1e-3)
        assert best[0].tolist() == target_logits[k:k + N].argmax(-1).tolist()
    for i in range(N):
        hkv = KVCache.allocate(1, 16, block, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
        meta, positions = metadata(0, i + 1)  # pairs (taps_j, t_{j+1}) for j = 0..i at positions 0..i
        y = head.layers[0](target.embed(ids[1:i + 2]), ctx[:i + 1], positions, rotary, hkv, meta, backend)[-1:]
        torch.testing.assert_close(logits(y)[0], trained[0][0][0, i], atol=1e-4, rtol=1e-4)
        for k in range(2, steps + 1):  # t_{i+k} (the draft, when right) and y, at position i + k - 1
            meta, positions = metadata(i + k - 1, 1)
            y = head.layers[0](target.embed(ids[i + k:i + k + 1]), y, positions, rotary, hkv, meta, backend)
            torch.testing.assert_close(logits(y)[0], trained[k - 1][0][0, i], atol=1e-4, rtol=1e-4)


def test_smoke_eagle3_head_decodes_through_the_engine_as_plain_greedy_and_drafts_as_the_training_code(smoke):
    """outrider.LLM with the smoke target and its EAGLE-3 head (spec_type eagle3, draft_model the head) gives the
    plain greedy output on the held-out prompts, and every draft is the one the trainer's own model code makes at
    that point (outrider_tools.acceptance, --vs-training-code)."""
    from outrider_tools import acceptance as ma

    out, _ = smoke
    prompts = list(enumerate(json.loads((out / "eval_prompts.json").read_text())))
    _, (res,) = ma.measure([("eagle3", 3)], prompts, max_tokens=24, vs_training_code=True,
                           target=str(out / "target"), draft_models={"eagle3": str(out / "eagle3")},
                           log=lambda *_: None)
    s = res.summary()
    # What the code guarantees, whatever a few smoke steps taught the head (acceptance is not guaranteed): plain
    # output, drafting every round, and each draft the training code's.
    assert s["identical"] == s["prompts"] == len(prompts)
    assert s["draft_rounds"] > 0 and s["rounds_consistent"]
    assert s["training_code_slots"] > 0 and s["training_code_equal"] == s["training_code_slots"]


def test_eagle3_stage_trains_against_an_existing_family_and_adds_to_its_metrics_and_log(smoke, tmp_path):
    """--stages eagle3 --family DIR: the family's target and tokenizer, the same corpus; --out gets the head and
    drop-in metrics.json (the family's plus the stage, with its run) and train_log.txt (the family's, continued);
    --pack returns the head as one tar beside them."""
    family, before = smoke
    out, packed = tmp_path / "out", tmp_path / "pack"
    after = run_smoke(out, pack=packed, extra=("--stages", "eagle3", "--family", str(family)))
    assert sorted(f.name for f in out.iterdir()) == ["eagle3", "metrics.json", "train_log.txt"]
    assert sorted(f.name for f in packed.iterdir()) == ["demo-eagle3.tar", "metrics.json", "train_log.txt"]
    with tarfile.open(packed / "demo-eagle3.tar") as tar:
        assert sorted(tar.getnames()) == ["eagle3", "eagle3/config.json", "eagle3/model.safetensors"]
    run = after["eagle3"]["run"]
    assert run["family"] == str(family) and run["corpus_matches_family"] and "--family" in run["command"]
    for key in ("target", "draft", "mtp", "dflash", "corpus", "samples", "generated", "seconds"):
        assert after[key] == before[key], key
    proxy = after["acceptance_proxy"]
    assert {k: v for k, v in proxy["all"].items() if not k.startswith("eagle3")} == {
        k: v for k, v in before["acceptance_proxy"]["all"].items() if not k.startswith("eagle3")}
    assert {f"eagle3_k{k}" for k in range(1, profiles.SMOKE.eagle3_steps + 1)} <= set(proxy["all"]) & set(proxy["def"])
    assert after["files"]["target/model.safetensors"] == before["files"]["target/model.safetensors"]
    assert after["total_bytes"] == sum(after["files"].values()) and "eagle3/model.safetensors" in after["files"]
    log = (out / "train_log.txt").read_text()
    assert log.startswith((family / "train_log.txt").read_text()) and "eagle3 step" in log.split("--- stages")[1]


def test_stages_without_the_target_need_a_family_and_the_target_stage_takes_none(tmp_path):
    for argv in (["--stages", "eagle3"], ["--family", str(tmp_path)], ["--stages", "target,eagle3", "--family", "x"],
                 ["--stages", "eagle"]):
        with pytest.raises(SystemExit):
            train.main(["--smoke", "--out", str(tmp_path / "o"), *argv])
    assert profiles.parse_stages("eagle3,draft") == ["draft", "eagle3"]  # they run in the script's order


def test_profile_overrides_replace_fields_merge_stage_caps_and_build_shapes():
    p = profiles.with_overrides(profiles.FULL, ["eagle3_train=(5, 64, 2e-3, 2)", "stage_seconds={'eagle3': 30}",
                                    "eagle3=(256, 1, 2, 1, 32, 64)", "gen_prompts=256"])
    assert p.eagle3_train == (5, 64, 2e-3, 2) and p.gen_prompts == 256
    assert p.stage_seconds == {**profiles.FULL.stage_seconds, "eagle3": 30} and p.eagle3 == profiles.Shape(256, 1, 2, 1, 32, 64)
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        profiles.with_overrides(profiles.FULL, ["no_such_field=1"])
