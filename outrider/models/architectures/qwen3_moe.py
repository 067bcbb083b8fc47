"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norm) with a sparse
MoE feed-forward block (layers/moe.py) in every layer that `decoder_sparse_step` / `mlp_only_layers` make sparse,
a dense SwiGLU of `intermediate_size` in the others. GGUF: llama.cpp's `qwen3moe` (models/moe_gguf.py)."""

from __future__ import annotations

from outrider.config import ModelConfig
from outrider.layers.moe import MoeConfig, SparseMoe
from outrider.models.decoder import CausalLM, DecoderLayer
from outrider.models.moe_gguf import MOE_GGUF_TENSORS, moe_gguf_config
from outrider.models.registry import Architecture, register


class MoeDecoderLayer(DecoderLayer):
    """The shared decoder layer, its MLP replaced by the MoE block where the config makes this layer sparse."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        moe = MoeConfig.from_dict(cfg.raw)
        if moe.is_sparse(layer_idx):
            self.mlp = SparseMoe(cfg.hidden_size, moe)


QWEN3_MOE = register(Architecture(
    name="qwen3_moe", hf_names=("Qwen3MoeForCausalLM",), model_type="qwen3_moe", model=CausalLM,
    decoder_layer=MoeDecoderLayer, config=lambda raw: {"qk_norm": True}, gguf_names=("qwen3moe",),
    gguf_config=moe_gguf_config, gguf_layer_tensors=MOE_GGUF_TENSORS,
    tiny_config={"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
                 "sliding_window": None, "attention_bias": False, "router_aux_loss_coef": 0.0},
))
