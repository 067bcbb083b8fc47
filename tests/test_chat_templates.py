"""llama-server's built-in chat template names: every one renders a conversation, and the well-known formats come
out as their model cards write them."""

import pytest

from outrider.chat_templates import BUILTIN_TEMPLATES
from outrider.tokenizer import _compile

# llama-server's names (src/llama-chat.cpp's table).
LLAMA_SERVER_NAMES = (
    "chatml llama2 llama2-sys llama2-sys-bos llama2-sys-strip mistral-v1 mistral-v3 mistral-v3-tekken mistral-v7 "
    "mistral-v7-tekken phi3 phi4 falcon3 zephyr monarch gemma orion openchat vicuna vicuna-orca deepseek deepseek2 "
    "deepseek3 command-r llama3 chatglm3 chatglm4 glmedge minicpm exaone3 exaone4 rwkv-world granite gigachat "
    "megrez yandex bailing llama4 smolvlm hunyuan-moe gpt-oss hunyuan-dense kimi-k2 seed_oss").split()
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye now"}]


def render(name: str, messages=CHAT, add_generation_prompt: bool = True) -> str:
    return _compile(BUILTIN_TEMPLATES[name]).render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_every_llama_server_name_is_built_in():
    assert sorted(BUILTIN_TEMPLATES) == sorted(LLAMA_SERVER_NAMES)


@pytest.mark.parametrize("name", LLAMA_SERVER_NAMES)
def test_each_template_renders_every_turn_in_order(name):
    text = render(name)
    positions = [text.find(m["content"]) for m in CHAT[1:]]  # (some formats have no system role)
    assert -1 not in positions and positions == sorted(positions), text


@pytest.mark.parametrize("name, expected", [
    ("chatml", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
               "Hello<|im_end|>\n<|im_start|>user\nBye now<|im_end|>\n<|im_start|>assistant\n"),
    ("llama3", "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
               "<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nBye now<|eot_id|><|start_header_id|>assistant"
               "<|end_header_id|>\n\n"),
    # Gemma has no system role: the system prompt opens the first user turn.
    ("gemma", "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
              "<start_of_turn>user\nBye now<end_of_turn>\n<start_of_turn>model\n"),
    ("mistral-v7", "[SYSTEM_PROMPT] Be brief.[/SYSTEM_PROMPT][INST] Hi there[/INST] Hello</s>[INST] Bye now[/INST]"),
    ("llama2-sys", "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST]Hello</s>[INST] Bye now [/INST]"),
    ("phi3", "<|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\nHello<|end|>\n<|user|>\n"
             "Bye now<|end|>\n<|assistant|>\n"),
])
def test_known_formats(name, expected):
    assert render(name) == expected


def test_the_generation_prompt_is_optional():
    assert render("chatml", add_generation_prompt=False).endswith("Bye now<|im_end|>\n")
    assert render("llama3", add_generation_prompt=False).endswith("Bye now<|eot_id|>")
