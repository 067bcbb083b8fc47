"""llama-server's built-in chat template names (`--chat-template NAME`), each written here as a Jinja template.

Every template is a table: per role, the parts of a message's turn; `C` stands for the message's content (trimmed
where the format trims it) and `ROLE` for its role; `gen` is the generation prompt. A few formats need more state
than that (a system message folded into the next user turn, a turn left open across messages) and say so.
"""

from __future__ import annotations

import json

C, ROLE = object(), object()  # placeholders in a turn's parts
_ELSE = "*"  # the row for every role the table does not name


def _expr(parts: tuple) -> str:
    """A Jinja expression joining literal strings (as JSON literals, which Jinja reads) and placeholders."""
    return " ~ ".join("c" if p is C else "m.role" if p is ROLE else p if p.startswith("(") else json.dumps(p)
                      for p in parts)


def _template(turns: dict[str, tuple], gen: tuple = (), head: str = "", trim: bool = False) -> str:
    """`head`, then each message's turn by its role (unnamed roles: the `*` row, else nothing), then `gen`."""
    rows = [(role, parts) for role, parts in turns.items() if role != _ELSE]
    body = "".join(("{% if " if i == 0 else "{% elif ") + f"m.role == {json.dumps(role)} %}}{{{{ {_expr(parts)} }}}}"
                   for i, (role, parts) in enumerate(rows))
    if _ELSE in turns:
        body = body + "{% else %}" if rows else ""
        body += f"{{{{ {_expr(turns[_ELSE])} }}}}"
    if rows:
        body += "{% endif %}"
    content = "m.content | trim" if trim else "m.content"
    out = (f"{{{{ {json.dumps(head)} }}}}" if head else "") + f"{{% for m in messages %}}{{% set c = {content} %}}"
    out += body + "{% endfor %}"
    return out + (f"{{% if add_generation_prompt %}}{{{{ {_expr(gen)} }}}}{{% endif %}}" if gen else "")


def _every_role(*parts, gen: tuple = (), head: str = "", trim: bool = False) -> str:
    return _template({_ELSE: parts}, gen, head, trim)


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    """[INST] turns: a turn opens at the start and after each reply; the system prompt goes inside the first."""
    reopen = "<s>[INST] " if bos_inside else "[INST] "
    sys_parts = ("<<SYS>>\n", C, "\n<</SYS>>\n\n") if system else (C, "\n")
    reply = (C, "</s>", f"('' if loop.last else {json.dumps(reopen)})")
    return _template({"system": sys_parts, "user": (C, " [/INST]"), _ELSE: reply}, head="[INST] ", trim=strip)


def _mistral(lead: str, trail: str, trim_reply: bool) -> str:
    """v1/v3: [INST] opens before the first message and after each reply; a system prompt sits inside it."""
    opening = f"((\"{lead}[INST]{trail}\") if loop.first or loop.previtem.role not in ('system', 'user') else '')"
    reply = (opening, trail, "(m.content | trim)" if trim_reply else C, "</s>")
    return _template({"system": (opening, C, "\n\n"), "user": (opening, C, f"{lead}[/INST]"), _ELSE: reply})


def _mistral_v7(space: str) -> str:
    return _template({"system": (f"[SYSTEM_PROMPT]{space}", C, "[/SYSTEM_PROMPT]"),
                      "user": (f"[INST]{space}", C, "[/INST]"), _ELSE: (space, C, "</s>")})


# Formats whose system message joins the next user turn (they have no system role).
_GEMMA = ("{% set ns = namespace(sys='') %}{% for m in messages %}{% if m.role == 'system' %}"
          "{% set ns.sys = ns.sys ~ (m.content | trim) %}{% else %}"
          "{% set r = 'model' if m.role == 'assistant' else m.role %}{{ '<start_of_turn>' ~ r ~ '\\n' }}"
          "{% if ns.sys and r != 'model' %}{{ ns.sys ~ '\\n\\n' }}{% set ns.sys = '' %}{% endif %}"
          "{{ (m.content | trim) ~ '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
_ORION = ("{% set ns = namespace(sys='') %}{% for m in messages %}{% if m.role == 'system' %}"
          "{% set ns.sys = ns.sys ~ m.content %}{% elif m.role == 'user' %}{{ 'Human: ' }}"
          "{% if ns.sys %}{{ ns.sys ~ '\\n\\n' }}{% set ns.sys = '' %}{% endif %}"
          "{{ m.content ~ '\\n\\nAssistant: </s>' }}{% else %}{{ m.content ~ '</s>' }}{% endif %}{% endfor %}")

_VICUNA_TURNS = {"user": ("USER: ", C, "\n"), "assistant": ("ASSISTANT: ", C, "</s>\n")}
_EXAONE_TURNS = {"system": ("[|system|]", C, "[|endofturn|]\n"), "user": ("[|user|]", C, "\n"),
                 "assistant": ("[|assistant|]", C, "[|endofturn|]\n")}

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": _every_role("<|im_start|>", ROLE, "\n", C, "<|im_end|>\n", gen=("<|im_start|>assistant\n",)),
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral(" ", " ", trim_reply=False),
    "mistral-v3": _mistral("", " ", trim_reply=True),
    "mistral-v3-tekken": _mistral("", "", trim_reply=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _every_role("<|", ROLE, "|>\n", C, "<|end|>\n", gen=("<|assistant|>\n",)),
    "phi4": _every_role("<|im_start|>", ROLE, "<|im_sep|>", C, "<|im_end|>", gen=("<|im_start|>assistant<|im_sep|>",)),
    "falcon3": _every_role("<|", ROLE, "|>\n", C, "\n", gen=("<|assistant|>\n",)),
    "zephyr": _every_role("<|", ROLE, "|>\n", C, "<|endoftext|>\n", gen=("<|assistant|>\n",)),
    "monarch": _every_role("('' if loop.first else '<s>')", ROLE, "\n", C, "</s>\n", gen=("<s>assistant\n",)),
    "gemma": _GEMMA,
    "orion": _ORION,
    "openchat": _template({"system": (C, "<|end_of_turn|>"),
                           _ELSE: ("GPT4 Correct ", "(m.role | capitalize)", ": ", C, "<|end_of_turn|>")},
                          gen=("GPT4 Correct Assistant:",)),
    "vicuna": _template({"system": (C, "\n\n"), **_VICUNA_TURNS}, gen=("ASSISTANT:",)),
    "vicuna-orca": _template({"system": ("SYSTEM: ", C, "\n"), **_VICUNA_TURNS}, gen=("ASSISTANT:",)),
    "deepseek": _template({"system": (C,), "user": ("### Instruction:\n", C, "\n"),
                           "assistant": ("### Response:\n", C, "\n<|EOT|>\n")}, gen=("### Response:\n",)),
    "deepseek2": _template({"system": (C, "\n\n"), "user": ("User: ", C, "\n\n"),
                            "assistant": ("Assistant: ", C, "<｜end▁of▁sentence｜>")}, gen=("Assistant:",)),
    "deepseek3": _template({"system": (C, "\n\n"), "user": ("<｜User｜>", C),
                            "assistant": ("<｜Assistant｜>", C, "<｜end▁of▁sentence｜>")}, gen=("<｜Assistant｜>",)),
    "command-r": _template({role: (f"<|START_OF_TURN_TOKEN|><|{token}_TOKEN|>", C, "<|END_OF_TURN_TOKEN|>")
                            for role, token in (("system", "SYSTEM"), ("user", "USER"), ("assistant", "CHATBOT"))},
                           gen=("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",), trim=True),
    "llama3": _every_role("<|start_header_id|>", ROLE, "<|end_header_id|>\n\n", C, "<|eot_id|>",
                          gen=("<|start_header_id|>assistant<|end_header_id|>\n\n",), trim=True),
    "chatglm3": _every_role("<|", ROLE, "|>\n ", C, gen=("<|assistant|>",), head="[gMASK]sop"),
    "chatglm4": _every_role("<|", ROLE, "|>\n", C, gen=("<|assistant|>\n",), head="[gMASK]<sop>"),
    "glmedge": _every_role("<|", ROLE, "|>\n", C, gen=("<|assistant|>",)),
    "minicpm": _template({"user": ("<用户>", C, "<AI>"), _ELSE: (C,)}, trim=True),
    "exaone3": _template(_EXAONE_TURNS, gen=("[|assistant|]",), trim=True),
    "exaone4": _template({**_EXAONE_TURNS, "tool": ("[|tool|]", C, "[|endofturn|]\n")}, gen=("[|assistant|]",),
                         trim=True),
    "rwkv-world": _template({"system": ("System: ", C, "\n\n"),
                             "user": ("User: ", C, "\n\n", "('Assistant:' if loop.last else '')"),
                             "assistant": ("Assistant: ", C, "\n\n")}, trim=True),
    "granite": _every_role("<|start_of_role|>", ROLE, "<|end_of_role|>",
                           "('<|tool_call|>' if m.role == 'assistant_tool_call' else '')", C, "<|end_of_text|>\n",
                           gen=("<|start_of_role|>assistant<|end_of_role|>\n",)),
    "gigachat": _template({"system": ("(c ~ '<|message_sep|>' if loop.first else '')",),
                           "user": ("user<|role_sep|>", C,
                                    "<|message_sep|>available functions<|role_sep|>[]<|message_sep|>"),
                           "assistant": ("assistant<|role_sep|>", C, "<|message_sep|>")},
                          gen=("assistant<|role_sep|>",), head="<s>"),
    "megrez": _every_role("<|role_start|>", ROLE, "<|role_end|>", C, "<|turn_end|>",
                          gen=("<|role_start|>assistant<|role_end|>",)),
    "yandex": _template({"user": (" Пользователь: ", C, "\n\n"), "assistant": (" Ассистент: ", C, "\n\n")},
                        gen=(" Ассистент:[SEP]",)),
    "bailing": _every_role("<role>", "('HUMAN' if m.role == 'user' else m.role | upper)", "</role>", C,
                           gen=("<role>ASSISTANT</role>",)),
    "llama4": _every_role("<|header_start|>", ROLE, "<|header_end|>\n\n", C, "<|eot|>",
                          gen=("<|header_start|>assistant<|header_end|>\n\n",), trim=True),
    "smolvlm": _template({"system": (C, "\n\n"), "user": ("User: ", C, "<end_of_utterance>\n"),
                          _ELSE: ("Assistant: ", C, "<end_of_utterance>\n")}, gen=("Assistant:",), head="<|im_start|>"),
    "hunyuan-moe": _template({"system": ("<|startoftext|>", C, "<|extra_4|>"), "assistant": (C, "<|eos|>"),
                              _ELSE: ("<|startoftext|>", C, "<|extra_0|>")}),
    "gpt-oss": _every_role("<|start|>", ROLE, "<|message|>", C,
                           "('<|return|>' if m.role == 'assistant' else '<|end|>')", gen=("<|start|>assistant",)),
    "hunyuan-dense": _template({"system": ("(c ~ '<｜hy_place▁holder▁no▁3｜>' if loop.first else '')",),
                                "assistant": ("<｜hy_Assistant｜>", C, "<｜hy_place▁holder▁no▁2｜>"),
                                "user": ("<｜hy_User｜>", C, "<｜hy_Assistant｜>")}),
    "kimi-k2": _template({role: (prefix, C, "<|im_end|>") for role, prefix in (
        ("system", "<|im_system|>system<|im_middle|>"), ("user", "<|im_user|>user<|im_middle|>"),
        ("assistant", "<|im_assistant|>assistant<|im_middle|>"), ("tool", "<|im_system|>tool<|im_middle|>"))},
        gen=("<|im_assistant|>assistant<|im_middle|>",)),
    "seed_oss": _every_role("<seed:bos>", ROLE, "\n", "((m.content | trim) if m.role == 'assistant' else c)",
                            "<seed:eos>", gen=("<seed:bos>assistant\n",)),
}
