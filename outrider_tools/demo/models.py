"""The demo family's models are outrider's own modules: built here at a profile's shapes, written in the
checkpoint formats the server loads (Hugging Face tensor names; packed projections unpacked), and loaded back,
frozen, for training the drafters or checking the engine's drafts.

  target, draft  outrider.models.decoder.CausalLM (Qwen3: per-head q/k norm, tied embeddings)
  MTP            outrider.speculative.mtp.QwenMTP, saved under `mtp.` in the target's checkpoint
  DFlash         outrider.speculative.dflash.DFlashModel (Qwen3 layers; the target's embedding and LM head)
  EAGLE-3        outrider.speculative.eagle3.Eagle3Model, saved in the EAGLE reference layout (`midlayer.`, d2t, t2d)
They run for training through outrider_tools.dense.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from outrider.config import ModelConfig
from outrider.layers.rotary import rope_inv_freq
from outrider.models import load_model, read_tensors
from outrider.models import registry
from outrider.models.registry import build_model
from outrider.models.loader import checkpoint_layout
from outrider.speculative.dflash import DFlashModel
from outrider.speculative.eagle3 import Eagle3Model, load_eagle3
from outrider.speculative.mtp import QwenMTP, load_mtp_head
from outrider_tools import dense
from outrider_tools.demo.profiles import Shape
from outrider_tools.demo.tokenizer import EOS_IDS, EOT_ID, MAX_POSITIONS, write_tokenizer

ROPE_THETA = 10000.0
RMS_EPS = 1e-6


def layer_fields(s: Shape, vocab: int) -> dict:
    """The config fields of decoder layers of shape `s`."""
    return {
        "vocab_size": vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
    }


def qwen3_config(s: Shape, vocab: int, **extra) -> dict:
    """A target's or draft model's config.json."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **layer_fields(s, vocab),
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": s.layers,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": EOT_ID,
        "eos_token_id": EOS_IDS,
        "pad_token_id": EOT_ID,
        "torch_dtype": "bfloat16",
        **extra,
    }


def dflash_config(s: Shape, vocab: int, *, block_size: int, target_layers: int, taps, mask_id: int) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "num_target_layers": target_layers,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(taps)},
        **layer_fields(s, vocab),
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": False,
        "is_causal": False,
        "torch_dtype": "bfloat16",
    }


def eagle3_config(s: Shape, vocab: int, *, draft_vocab: int, target_hidden: int, taps,
                  norm_before_residual: bool) -> dict:
    """The EAGLE reference layout's config (vLLM and SGLang load it too): a Llama layer, draft_vocab_size,
    target_hidden_size, norm_before_residual and the taps as layer inputs (`eagle_aux_hidden_state_layer_ids`: id
    j is the output of layer j - 1)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **layer_fields(s, vocab),
        "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_hidden,
        "norm_before_residual": norm_before_residual,
        "eagle_config": {"use_aux_hidden_state": True,
                         "eagle_aux_hidden_state_layer_ids": [t + 1 for t in sorted(taps)]},
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def layer_config(config: dict) -> ModelConfig:
    """The outrider ModelConfig of a drafter config's layers (Qwen3 for DFlash, Llama for EAGLE-3)."""
    arch = "LlamaForCausalLM" if config["model_type"] == "llama" else "Qwen3ForCausalLM"
    return registry.model_config({**config, "architectures": [arch]})


def layer_inv_freq(config: dict, device) -> torch.Tensor:
    """RoPE's inverse frequencies for a drafter config's layers, on `device`."""
    cfg = layer_config(config)
    return rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings).to(device)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


# ---- building


def new_lm(s: Shape, vocab: int) -> dense.DenseLM:
    """A Qwen3 LM (a target or draft model), freshly initialised."""
    model = build_model(registry.model_config(qwen3_config(s, vocab)))
    init_weights(model)
    return dense.DenseLM(model)


def new_mtp(target_cfg: ModelConfig) -> QwenMTP:
    """A Qwen3.5-style MTP head for the target: one layer of the target's shape."""
    head = QwenMTP(target_cfg)
    init_weights(head)
    return head


@dataclass
class DFlash:
    """A DFlash drafter for training or checking: its module, config and what it reads."""

    model: DFlashModel
    config: dict  # its config.json

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(self.config["dflash_config"]["target_layer_ids"])

    @property
    def block_size(self) -> int:
        return self.config["block_size"]

    @property
    def mask_id(self) -> int:
        return self.config["dflash_config"]["mask_token_id"]

    def __call__(self, taps_cat, block_emb, block_pos, mask) -> torch.Tensor:
        inv_freq = layer_inv_freq(self.config, taps_cat.device)
        return dense.dflash_forward(self.model, inv_freq, taps_cat, block_emb, block_pos, mask)


def new_dflash(s: Shape, vocab: int, target_hidden: int, **config) -> DFlash:
    """dflash_config's keywords: block_size, target_layers, taps, mask_id."""
    raw = dflash_config(s, vocab, **config)
    model = DFlashModel(layer_config(raw), len(raw["dflash_config"]["target_layer_ids"]) * target_hidden)
    init_weights(model)
    return DFlash(model, raw)


@dataclass
class Eagle3:
    """An EAGLE-3 head for training or checking: draft id i is target id i + d2t[i]."""

    model: Eagle3Model
    config: dict  # its config.json

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(sorted(j - 1 for j in self.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]))

    def draft_ids(self) -> torch.Tensor:
        """The target id of each draft id."""
        d2t = self.model.d2t
        return torch.arange(len(d2t), device=d2t.device) + d2t

    def covers(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each target id is in the draft vocabulary (t2d)."""
        t2d = torch.zeros(self.config["vocab_size"], dtype=torch.bool, device=ids.device)
        return t2d.index_fill_(0, self.draft_ids().to(ids.device), True)[ids]

    def unroll(self, target: dense.DenseLM, taps_cat, ids, steps) -> list[torch.Tensor]:
        inv_freq = layer_inv_freq(self.config, taps_cat.device)
        return dense.eagle3_unroll(self.model, inv_freq, target.embed, taps_cat, ids, steps)

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """float32 logits over the draft vocabulary."""
        return dense.linear(self.model.lm_head, dense.norm(self.model.norm, y)).float()

    def drafts(self, y: torch.Tensor) -> torch.Tensor:
        """Argmax drafts as target ids."""
        return self.draft_ids()[self.logits(y).argmax(-1)]


def new_eagle3(s: Shape, vocab: int, target_hidden: int, taps, draft_ids: torch.Tensor,
               norm_before_residual: bool = False) -> Eagle3:
    raw = eagle3_config(s, vocab, draft_vocab=len(draft_ids), target_hidden=target_hidden, taps=taps,
                        norm_before_residual=norm_before_residual)
    model = Eagle3Model(layer_config(raw), target_hidden, len(taps), len(draft_ids), norm_before_residual)
    init_weights(model)
    model.d2t.copy_(draft_ids.long() - torch.arange(len(draft_ids)))
    return Eagle3(model, raw)


# ---- writing


def hf_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters under their checkpoint names (packed projections split into their parts)."""
    params = dict(module.named_parameters())
    return {name: params[slot.param].detach()[slot.row:slot.row + slot.shape[0]]
            for name, slot in checkpoint_layout(module).items()}


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    out = {k: v.detach().to("cpu", torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
           for k, v in sorted(tensors.items())}  # (EAGLE-3's d2t and t2d keep their integer and bool types)
    save_file(out, str(path), metadata={"format": "pt"})


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """An HF-style checkpoint directory: model.safetensors and config.json."""
    path.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_lm(path: Path, lm: dense.DenseLM, tok, extra_config: dict | None = None, mtp: QwenMTP | None = None,
             pretty_tokenizer: bool = True) -> None:
    """A Qwen3 checkpoint with its tokenizer; with `mtp`, the head's tensors under `mtp.` and its config key."""
    tensors = hf_tensors(lm.model)
    extra = dict(extra_config or {})
    if mtp is not None:
        tensors.update({f"mtp.{k}": v for k, v in hf_tensors(mtp).items()})
        extra.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    write_checkpoint(path, tensors, qwen3_config(Shape.of(lm.config), lm.config.vocab_size, **extra))
    gen_cfg = {"bos_token_id": EOT_ID, "eos_token_id": EOS_IDS, "pad_token_id": EOT_ID}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    write_tokenizer(tok, path, pretty_tokenizer)


def write_dflash(path: Path, drafter: DFlash) -> None:
    """The DFlash checkpoint outrider/speculative/dflash.py loads."""
    write_checkpoint(path, hf_tensors(drafter.model), drafter.config)


def write_eagle3(path: Path, head: Eagle3) -> None:
    """The EAGLE-3 head in the EAGLE reference layout outrider/speculative/eagle3.py (and vLLM, SGLang) load."""
    tensors = {k.replace("layers.0.", "midlayer.", 1): v for k, v in hf_tensors(head.model).items()}
    ids = head.draft_ids().cpu()
    tensors["d2t"] = head.model.d2t.cpu()
    tensors["t2d"] = torch.zeros(head.config["vocab_size"], dtype=torch.bool).index_fill_(0, ids, True)
    write_checkpoint(path, tensors, head.config)


# ---- loading (frozen, float32)


def load_lm(path: Path, device="cpu") -> dense.DenseLM:
    """A Qwen3 LM checkpoint (a target, its MTP tensors left out, or a draft model) through outrider's loader."""
    model, _ = load_model(str(path), dtype="float32", device=device)
    return dense.DenseLM(model.eval().requires_grad_(False))


def load_mtp(target_path: Path, target: dense.DenseLM) -> QwenMTP:
    """The Qwen3.5-style MTP head stored in the target's checkpoint, through outrider's loader."""
    layout, head = load_mtp_head(str(target_path), target.config, torch.float32, target.inv_freq.device)
    if layout != "qwen":
        raise ValueError(f"{target_path}: a {layout} MTP head, not the demo's Qwen3.5 layout")
    return head


def load_dflash(path: Path, device="cpu") -> DFlash:
    raw = json.loads((Path(path) / "config.json").read_text())
    model = DFlashModel(layer_config(raw), len(raw["dflash_config"]["target_layer_ids"]) * raw["hidden_size"])
    model.load_state_dict({k: v.float() for k, v in read_tensors(str(path)).items()})
    return DFlash(model.to(device).eval().requires_grad_(False), raw)


def load_eagle3_head(path: Path, target_cfg: ModelConfig, device="cpu") -> Eagle3:
    """An EAGLE-3 head through outrider's loader (eagle3.load_eagle3)."""
    model, _, _ = load_eagle3(str(path), target_cfg)
    raw = json.loads((Path(path) / "config.json").read_text())
    return Eagle3(model.to(device).float().eval().requires_grad_(False), raw)
