"""MiMo (Xiaomi MiMo-7B): a Qwen2 body (biases on q/k/v, not on o) with MTP layers under `model.mtp_layers.*`
in the same checkpoint, which the target does not own: the loader leaves them to the MTP drafter
(speculative/mtp.py, layout "mimo"), detected from `num_nextn_predict_layers`. llama.cpp converts MiMo's body as
`qwen2`, which loads as Qwen2."""

from __future__ import annotations

from outrider.models.decoder import CausalLM, DecoderLayer
from outrider.models.registry import Architecture, register

MIMO = register(Architecture(
    name="mimo", hf_names=("MiMoForCausalLM",), model_type="mimo", model=CausalLM, decoder_layer=DecoderLayer,
    config=lambda raw: {"attention_bias": True, "o_proj_bias": False},
    tiny_config={"use_sliding_window": False, "sliding_window": None, "attention_bias": True,
                 "num_nextn_predict_layers": 0},
))
