"""`POST /infill`: fill-in-the-middle with llama-server's fields and its documented prompt format, answered as
`/completion` answers (every /completion option applies).

With repository tokens (FIM_REP and FIM_SEP: Qwen2.5-Coder, StarCoder, SmolLM) the repo-level pattern:

    <FIM_REP>myproject\\n<FIM_SEP>{filename}\\n{text}...<FIM_SEP>filename\\n<FIM_PRE>{prefix}<FIM_SUF>{suffix}<FIM_MID>{prompt}

without them the extra chunks go first, each after a "\\n\\n--- snippet ---\\n\\n" line:

    {extra}<FIM_PRE>{prefix}<FIM_SUF>{suffix}<FIM_MID>{prompt}

As llama-server, the prefix keeps at most its last 3/4 of a batch (`-b`) of tokens, the suffix its first quarter
less the prompt, and the extra context its last `n_ctx - batch - 2 * n_predict` tokens; BOS goes first when the
tokenizer adds one. Texts are tokenized without reading special tokens in them.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from outrider.server import protocol as proto
from outrider.server.errors import ApiError, invalid
from outrider.server.native import complete, state_of
from outrider.server.transport import read_json
from outrider.tokenizer import FimTokens, Tokenizer

router = APIRouter()

SNIPPET = "\n\n--- snippet ---\n\n"
FIELDS = ("input_prefix", "input_suffix", "input_extra", "prompt")


def _chunks(extra: Any) -> list[tuple[str, str]]:
    """`input_extra`: [{filename, text}] (filename defaults to "tmp", as llama-server's)."""
    if extra is None:
        return []
    if not isinstance(extra, list):
        raise invalid("input_extra", 'expected an array of {"filename": string, "text": string}')
    chunks = []
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str) \
                or not isinstance(chunk.get("filename", "tmp"), str):
            raise invalid(f"input_extra[{i}]", 'expected {"filename": string, "text": string}')
        chunks.append((chunk.get("filename", "tmp"), chunk.get("text", "")))
    return chunks


def infill_ids(tok: Tokenizer, fim: FimTokens, prefix: str, suffix: str, extra: list[tuple[str, str]], prompt: str,
               n_batch: int, n_ctx: int, n_predict: int) -> list[int]:
    """The FIM prompt's token ids (the module docstring's format and limits)."""
    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=False)

    repo_level = fim.rep is not None and fim.sep is not None
    extra_ids: list[int] = [fim.rep, *enc("myproject\n")] if repo_level else []
    for filename, text in extra:
        extra_ids += [fim.sep, *enc(filename + "\n")] if repo_level else enc(SNIPPET)
        extra_ids += enc(text)
    if repo_level:
        extra_ids += [fim.sep, *enc("filename\n")]
    prompt_ids, prefix_ids, suffix_ids = enc(prompt), enc(prefix), enc(suffix)
    n_prefix = min(len(prefix_ids), 3 * (n_batch // 4))
    n_suffix = min(len(suffix_ids), max(0, n_batch // 4 - (2 + len(prompt_ids))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * max(n_predict, 0)), len(extra_ids))
    bos = [tok.bos_token_id] if tok.add_bos else []
    return [*bos, *extra_ids[len(extra_ids) - n_extra:], fim.pre, *prefix_ids[len(prefix_ids) - n_prefix:],
            fim.suf, *suffix_ids[:n_suffix], fim.mid, *prompt_ids]


@router.post("/infill")
async def infill(request: Request):
    state = state_of(request)
    body = await read_json(request)
    fim = state.tokenizer.fim_tokens
    if fim is None:
        raise ApiError(400, "Infill is not supported by this model: its vocabulary has no fill-in-the-middle "
                            "(prefix, suffix, middle) tokens")
    for name in ("input_prefix", "input_suffix"):
        if not isinstance(body.get(name), str):
            raise invalid(name, "required, a string")
    prompt = body.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise invalid("prompt", "expected a string")
    n_predict = proto.get_int(body, proto.first_present(body, ("n_predict", "max_tokens")), -1, lo=-1)
    ids = infill_ids(state.tokenizer, fim, proto.fits(body["input_prefix"], state.tokenizer, state.n_ctx),
                     proto.fits(body["input_suffix"], state.tokenizer, state.n_ctx), _chunks(body.get("input_extra")),
                     proto.fits(prompt, state.tokenizer, state.n_ctx), state.engine.config.max_num_batched_tokens,
                     state.n_ctx, n_predict)
    # (the FIM fields are this route's: /completion reads the rest)
    return await complete(request, {k: v for k, v in body.items() if k not in FIELDS}, [ids])
