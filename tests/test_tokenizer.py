"""Tokenizer, chat templates and the incremental Detokenizer, on the tiny trained tokenizer."""

import json
import shutil
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outrider.testing.tokenizer import BOS_TOKEN, EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, write_tiny_tokenizer
from outrider.tokenizer import ChatTemplateError, Detokenizer, Tokenizer

TEXTS = ["hello world", "def f(x):\n    return x + 1\n", "café naïve 中文文本 😀🎉 👨‍👩‍👧", "  leading spaces", ""]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory):
    """A SentencePiece-style (Llama 2) tokenizer: "▁" for spaces, byte fallback, a decoder that strips one space."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, trainers

    path = tmp_path_factory.mktemp("spm")
    tok = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(TEXTS * 50, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer.from_pretrained(path)


def copy_dir(src, dst, **config_changes):
    """A copy of the tokenizer directory with tokenizer_config.json keys changed."""
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **config_changes}))
    return dst


def stream(tok, ids, stop=(), chunk=1, skip_special_tokens=True):
    """Feed `ids` `chunk` at a time; return (chunks, stop word, detokenizer)."""
    detok = Detokenizer(tok, stop=stop, skip_special_tokens=skip_special_tokens)
    chunks, word = [], None
    for i in range(0, len(ids), chunk):
        text, word = detok.push(ids[i:i + chunk])
        chunks.append(text)
        if word is not None:
            break
    if word is None:
        chunks.append(detok.flush())  # a stop can still match in the held-back tail
    return chunks, detok.stop_word, detok


def first_stop(text, stops):
    """Oracle: check the text one character at a time; the first stop to end wins (the longer one on ties)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            word = max(hits, key=len)
            return text[:end - len(word)], word
    return text, None


# --- write_tiny_tokenizer -------------------------------------------------------------------------------------


def test_tiny_tokenizer_is_deterministic_and_fast(tmp_path):
    t0 = time.perf_counter()
    assert write_tiny_tokenizer(tmp_path / "a") == 512
    assert time.perf_counter() - t0 < 2.0
    assert write_tiny_tokenizer(tmp_path / "b") == 512
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (tmp_path / "b/tokenizer.json").read_bytes()
    assert write_tiny_tokenizer(tmp_path / "c", vocab_size=300) == 300


def test_tiny_tokenizer_loads_in_transformers(tok_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    for kwargs in ({}, {"tools": tools}):
        assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs) == \
            tok.apply_chat_template(messages, **kwargs)


# --- encode / decode ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special=False)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_bos_follows_the_checkpoint(tok, tok_dir, tmp_path):
    assert tok.bos_token_id == tok.encode(BOS_TOKEN, add_special=False)[0]
    assert tok.add_bos and tok.encode("hi")[0] == tok.bos_token_id
    assert tok.bos_token_id not in tok.encode("hi", add_special=False)
    assert tok.decode(tok.encode("hi"), skip_special_tokens=True) == "hi"

    no_bos = tmp_path / "no_bos"
    write_tiny_tokenizer(no_bos, add_bos_token=False)
    assert Tokenizer.from_pretrained(no_bos).encode("hi") == tok.encode("hi", add_special=False)
    # tokenizer_config's add_bos_token wins over the tokenizer.json post-processor
    overridden = Tokenizer.from_pretrained(copy_dir(tok_dir, tmp_path / "override", add_bos_token=False))
    assert not overridden.add_bos and overridden.encode("hi") == tok.encode("hi", add_special=False)


def test_parse_special(tok):
    eos_id = tok.encode(EOS_TOKEN, add_special=False)
    assert len(eos_id) == 1 and eos_id[0] in tok.eos_token_ids
    literal = tok.encode(f"a{EOS_TOKEN}b", add_special=False, parse_special=False)
    assert not set(literal) & tok.eos_token_ids and len(literal) > 3
    assert tok.decode(literal) == f"a{EOS_TOKEN}b"
    assert tok.encode(f"a{EOS_TOKEN}", add_special=False)[-1] == eos_id[0]  # the shared tokenizer is unaffected


def test_token_piece(tok):
    assert tok.token_piece(tok.encode(MASK_TOKEN, add_special=False)[0]) == MASK_TOKEN
    split = tok.encode("中", add_special=False)
    assert len(split) > 1 and "\ufffd" in tok.token_piece(split[0])  # a byte of a 3-byte character
    assert tok.token_piece(tok.vocab_size + 10) == ""


def test_eos_ids_are_collected(tok, tok_dir, tmp_path):
    ids = {t: tok.encode(t, add_special=False)[0] for t in (EOS_TOKEN, PAD_TOKEN, "<|im_start|>")}
    assert tok.eos_token_ids == {ids[EOS_TOKEN], ids[PAD_TOKEN]}  # eos + the <|endoftext|> end-of-generation

    path = copy_dir(tok_dir, tmp_path / "eos")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 9, "text_config": {"eos_token_id": 10}}))
    assert Tokenizer.from_pretrained(path).eos_token_ids == {ids[EOS_TOKEN], ids[PAD_TOKEN], 7, 8, 9, 10}


# --- chat templates -------------------------------------------------------------------------------------------


def test_chat_template_renders(tok):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == \
        "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages[1:], add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_chat_template_flattens_text_parts_and_parses_tool_arguments(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "a\n\nb"}])
    call = {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    out = tok.apply_chat_template([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert '{"name": "f", "arguments": {"x": 1}}' in out
    with pytest.raises(ChatTemplateError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_chat_template_sources_and_helpers(tok_dir, tmp_path):
    path = copy_dir(tok_dir, tmp_path / "t")
    template = "{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}{% endfor %}{{ flag }}"
    (path / "chat_template.jinja").write_text(template)  # preferred over tokenizer_config.json's
    tok = Tokenizer.from_pretrained(path)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}], flag="!") == '"é"!'  # BOS: encode's job
    tok.chat_template = "<{{ bos_token }}>"
    assert tok.apply_chat_template([]) == f"<{BOS_TOKEN}>"
    tok.chat_template = "{{ strftime_now('%Y') }}"
    assert tok.apply_chat_template([]).isdigit()
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tok.apply_chat_template([])
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([])
    assert Tokenizer.from_pretrained(path, chat_template="X").apply_chat_template([]) == "X"


@pytest.mark.parametrize("attack", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['json'] }}",
    "{% set _ = messages.append(1) %}",  # immutable sandbox: no mutating the caller's objects
])
def test_sandbox_blocks_attacks(tok_dir, attack):
    tok = Tokenizer.from_pretrained(tok_dir, chat_template=attack)
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# --- Detokenizer ----------------------------------------------------------------------------------------------


def test_stream_without_stops_matches_decode(tok):
    text = "The café serves 中文 and 😀 emoji. " * 3
    ids = tok.encode(text, add_special=False)
    for chunk in (1, 3, 100):
        chunks, word, detok = stream(tok, ids, chunk=chunk)
        assert "".join(chunks) == detok.text == text and word is None


def test_multibyte_characters_split_across_tokens_stream_intact(tok):
    text = "中文 😀🎉 👨‍👩‍👧 crème brûlée"
    ids = tok.encode(text, add_special=False)
    assert any("\ufffd" in tok.token_piece(i) for i in ids)  # the test really splits characters
    chunks, _, _ = stream(tok, ids)
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == text


def test_stop_spanning_tokens_is_cut_exactly(tok):
    text = "hello world, this is a test of stopping"
    stop = "s is a t"
    ids = tok.encode(text, add_special=False)
    assert len(tok.encode(stop, add_special=False)) > 1
    for chunk in (1, 2, 5, len(ids)):
        chunks, word, detok = stream(tok, ids, stop=("never", stop), chunk=chunk)
        assert word == stop == detok.stop_word
        assert "".join(chunks) == detok.text == text[:text.index(stop)]
        assert detok.push(tok.encode("more", add_special=False)) == ("", None) and detok.flush() == ""


def test_stop_prefix_is_held_then_released(tok):
    text = "one two three"
    ids = tok.encode(text, add_special=False)
    detok = Detokenizer(tok, stop=(" two four",))
    emitted, lag = "", 0
    for n, i in enumerate(ids, 1):
        emitted += detok.push([i])[0]
        lag = max(lag, len(tok.decode(ids[:n])) - len(emitted))
    assert lag == len(" two")  # " two" was held back as the start of " two four" ...
    assert emitted + detok.flush() == text  # ... and released once it stopped matching


def test_first_stop_to_end_wins_regardless_of_batching(tok):
    ids = tok.encode("xxabcdyy", add_special=False)
    for chunk in (1, len(ids)):
        chunks, word, _ = stream(tok, ids, stop=("abcd", "bc"), chunk=chunk)
        assert ("".join(chunks), word) == ("xxa", "bc")


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode(f"hi{EOS_TOKEN}", add_special=False)
    assert "".join(stream(tok, ids)[0]) == "hi"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == f"hi{EOS_TOKEN}"


def test_ids_that_add_no_text_do_not_grow_the_decode_window(tok, spm_tok):
    """A long run of skipped specials (or ids past the vocabulary) between text leaves the text as a whole decode
    gives it, and each push decodes a window of a token or two, not the run so far."""
    for t in (tok, spm_tok):
        eos = next(iter(t.eos_token_ids))
        a, b = t.encode("hello", add_special=False), t.encode(" there 中", add_special=False)
        ids = a + [eos] * 300 + [t.vocab_size + 7] * 50 + b
        detok = Detokenizer(t)
        text = ""
        for i in ids:
            text += detok.push([i])[0]
            assert len(detok._window) <= 4
        assert text + detok.flush() == t.decode(ids, skip_special_tokens=True)


def test_context_keeps_output_as_it_reads_mid_text(tok):
    prompt, out = tok.encode("say", add_special=False), tok.encode(" hello there", add_special=False)
    detok = Detokenizer(tok, context=prompt[-4:])
    text = "".join(detok.push([i])[0] for i in out) + detok.flush()
    assert text == " hello there"


def test_sentencepiece_style_spaces_survive_streaming(spm_tok):
    prompt = spm_tok.encode("hello", add_special=False)
    out = spm_tok.encode("world  </s> café 中", add_special=False) + spm_tok.encode(" x", add_special=False)
    assert "\ufffd" not in spm_tok.decode(out) and spm_tok.eos_token_ids == {spm_tok.encode("</s>")[-1]}
    expected = spm_tok.decode(prompt + out, skip_special_tokens=True)[len(spm_tok.decode(prompt)):]
    detok = Detokenizer(spm_tok, context=prompt[-4:])
    assert "".join(detok.push([i])[0] for i in out) + detok.flush() == expected  # " world  café 中 x"
    assert spm_tok.token_bytes(spm_tok.encode("\x01", add_special=False)[-1]) == b"\x01"  # a byte-fallback token


def test_whole_text_reads_the_same_mid_text(tok, spm_tok):
    """The Detokenizer's fast path: after a token of whole characters, a token of whole characters adds exactly
    its own text (byte-level decoder); tokens that split a character, added tokens and other decoders opt out."""
    whole = {i: tok.whole_text(i) for i in range(tok.vocab_size) if tok.whole_text(i)}
    assert len(whole) > tok.vocab_size // 2
    for a, text_a in whole.items():
        for b, text_b in whole.items():
            assert tok.decode([a, b]) == text_a + text_b
    split = next(i for i in tok.encode("中文 😀", add_special=False) if "\ufffd" in tok.token_piece(i))
    assert tok.whole_text(split) == "" and tok.whole_text(tok.encode(EOS_TOKEN, add_special=False)[0]) == ""
    assert not any(spm_tok.whole_text(i) for i in range(spm_tok.vocab_size))


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab c<>\n", max_size=24),
       stops=st.lists(st.text(alphabet="ab c<>\n", min_size=1, max_size=5), min_size=1, max_size=3))
def test_held_back_text_is_the_longest_tail_that_starts_a_stop(tok, text, stops):
    """While no stop matched, exactly the longest tail of the text that could begin a stop string is held back."""
    detok = Detokenizer(tok, stop=tuple(stops))
    ids = tok.encode(text, add_special=False)
    for n in range(1, len(ids) + 1):
        detok.push(ids[n - 1:n])
        seen = tok.decode(ids[:n])
        if detok.stop_word is not None:
            break
        tails = [k for k in range(1, len(seen) + 1) if any(len(s) > k and s.startswith(seen[-k:]) for s in stops)]
        assert len(seen) - len(detok.text) == max(tails, default=0)


@st.composite
def token_runs(draw):
    """Random token ids (specials included) and stop strings: some cut from the decoded text, some random."""
    ids = draw(st.lists(st.integers(0, 511), max_size=40))
    return ids, draw(st.integers(1, 4)), draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(run=token_runs())
def test_property_stream_equals_full_decode(tok, run):
    ids, chunk, skip = run
    chunks, word, _ = stream(tok, ids, chunk=chunk, skip_special_tokens=skip)
    assert word is None and "".join(chunks) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=300, deadline=None)
@given(run=token_runs(), data=st.data())
def test_property_stream_cuts_at_first_stop(tok, run, data):
    ids, chunk, skip = run
    full = tok.decode(ids, skip_special_tokens=skip)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if full and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[start:start + data.draw(st.integers(1, 6))])
        else:
            stops.append(data.draw(st.text(alphabet="abc e\n中", min_size=1, max_size=3)))
    chunks, word, _ = stream(tok, ids, stop=tuple(stops), chunk=chunk, skip_special_tokens=skip)
    assert ("".join(chunks), word) == first_stop(full, stops)
