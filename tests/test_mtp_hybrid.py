"""The MTP head of a hybrid target as released (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: `mtp.*` beside the model, its
norms stored as w for (1 + w), its layer the model's full-attention layer with the model's MLP or MoE) against a
from-the-spec reference of the MTP forward: fc([pre_fc_norm_embedding(embed(t_{i+1})); pre_fc_norm_hidden(h_i)])
-> one decoder layer (transformers' own full-attention layer of the target, causal) -> norm -> the target's LM
head, with h_i transformers' final-norm hidden state. transformers has no MTP module, so its layer, norms and
target stand in for the parts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from outrider.attention import KVCache
from outrider.attention.metadata import build_metadata
from outrider.attention.torch_ref import TorchReferenceBackend
from outrider.models import load_model, registry
from outrider.speculative.drafter import TargetView
from outrider.speculative.mtp import load_mtp_head
from outrider.testing.checkpoints import write_multimodal_release
from outrider.testing.drafters import write_mtp_checkpoint
from tests.test_models_hybrid import HybridRunner

transformers = pytest.importorskip("transformers")

IDS = [1, 17, 99, 200, 7, 31, 64, 5, 300, 12, 44]
CASES = {"qwen3_5": {}, "qwen3_next": {}, "qwen3_5_moe": {"fused_experts": True}}
BLOCK = 4


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch = request.param
    path = write_mtp_checkpoint(tmp_path_factory.mktemp(arch), "qwen", arch=arch, layers=4, **CASES[arch])
    target, cfg = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return arch, path, target, cfg, hf


class ReferenceMTP:
    """The MTP forward from its definition, over whole sequences (no cache), out of transformers' parts and the
    checkpoint's raw `mtp.*` tensors."""

    def __init__(self, hf, tensors: dict[str, torch.Tensor], arch: str):
        config = hf.config
        full = config.layer_types.index("full_attention")
        layer_cls, norm_cls = type(hf.model.layers[full]), type(hf.model.norm)
        self.layer = layer_cls(config, full).eval()
        self.layer.load_state_dict(_fused_experts({k[len("mtp.layers.0."):]: v for k, v in tensors.items()
                                                   if k.startswith("mtp.layers.0.")}), strict=True)
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
            norm.load_state_dict({"weight": tensors[f"mtp.{name}.weight"]})
            self.norms[name] = norm.eval()
        self.fc = tensors["mtp.fc.weight"]
        self.hf, self.mrope = hf, arch != "qwen3_next"

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, logits) at positions 0..T-1 for pairs (hidden[i], tokens[i])."""
        emb = self.hf.model.embed_tokens(tokens)[None]
        x = torch.cat([self.norms["pre_fc_norm_embedding"](emb), self.norms["pre_fc_norm_hidden"](hidden[None])],
                      dim=-1) @ self.fc.T  # the embedding first, then the hidden state
        t = x.shape[1]
        positions = torch.arange(t)[None]
        rope = self.hf.model.rotary_emb(x, positions[None].expand(3, 1, -1) if self.mrope else positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        y = self.norms["norm"](self.layer(x, position_embeddings=rope, attention_mask=mask, position_ids=positions))
        return y[0], self.hf.lm_head(y)[0]


def _fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (experts.{e}.{gate,up,down}_proj.weight) as transformers' fused expert
    parameters (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    n = len({k.split(".")[2] for k in state if k.startswith("mlp.experts.") and k.endswith("down_proj.weight")})
    if "mlp.experts.gate_up_proj" in state or n == 0:
        return state
    out = {k: v for k, v in state.items() if not k.startswith("mlp.experts.")}
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([state[f"mlp.experts.{e}.gate_proj.weight"],
                                                              state[f"mlp.experts.{e}.up_proj.weight"]])
                                                   for e in range(n)])
    out["mlp.experts.down_proj"] = torch.stack([state[f"mlp.experts.{e}.down_proj.weight"] for e in range(n)])
    return out


def _final_hidden(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0]


def test_mtp_head_matches_the_reference_forward_and_chain(case):
    """Step 1 over every committed pair (t_{i+1}, h_i) through the head's paged KV, then one chained step fed the
    head's own output and draft, give the reference's logits."""
    arch, path, target, cfg, hf = case
    layout, head = load_mtp_head(str(path), cfg, torch.float32, torch.device("cpu"))
    assert layout == "qwen"
    ref = ReferenceMTP(hf, load_file(path / "model.safetensors"), arch)
    view = TargetView.of(target)
    h = _final_hidden(hf, IDS)[:-1]  # h_0..h_{n-2}, paired with t_1..t_{n-1}
    tokens = torch.tensor(IDS[1:])
    n = len(tokens)
    kv = KVCache.allocate(1, 8, BLOCK, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    blocks = [5, 2, 7, 0, 3, 1, 6, 4]  # the head's KV lives in the request's (unordered) blocks
    meta, positions = build_metadata([(blocks, 0, n)], BLOCK, "cpu")
    with torch.no_grad():
        y = head(view.embed(tokens), h, positions, view.rotary, kv, meta, TorchReferenceBackend())
        logits = view.lm_head(y)
    ref_y, ref_logits = ref(tokens, h)
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=0)
    draft = int(logits[-1].argmax())
    meta, positions = build_metadata([(blocks, n, 1)], BLOCK, "cpu")
    with torch.no_grad():
        chained = view.lm_head(head(view.embed(torch.tensor([draft])), y[-1:], positions, view.rotary, kv, meta,
                                    TorchReferenceBackend()))
    _, ref_chained = ref(torch.cat([tokens, torch.tensor([draft])]), torch.cat([h, ref_y[-1:]]))
    torch.testing.assert_close(chained[0], ref_chained[-1], atol=2e-4, rtol=0)


def test_our_target_gives_the_mtp_head_the_reference_hidden_state(case):
    """What the drafter reads (the target's final-norm hidden, TargetView.final_norm of the forward's hidden) is
    transformers' last_hidden_state, so the head above sees the same input when served."""
    _, _, target, _, hf = case
    out = HybridRunner(target, 1).forward([IDS])
    torch.testing.assert_close(TargetView.of(target).final_norm(out.hidden), _final_hidden(hf, IDS), atol=2e-4,
                               rtol=0)


def test_the_released_multimodal_layout_detects_and_loads_its_mtp_head(tmp_path):
    """Qwen3.5 as released: Qwen3_5ForConditionalGeneration, keys under text_config (mtp_num_hidden_layers there),
    the decoder under model.language_model., the head's tensors at the top level as `mtp.*`: the config announces
    the head (what the engine's no-flag detection reads) and the head loads the same as from the text-only layout."""
    text = write_mtp_checkpoint(tmp_path / "text", "qwen", arch="qwen3_5", layers=4)
    full = write_multimodal_release(text, tmp_path / "full")
    cfg = registry.load_config(full)
    assert cfg.mtp_num_hidden_layers == 1
    _, a = load_mtp_head(str(text), registry.load_config(text), torch.float32, torch.device("cpu"))
    _, b = load_mtp_head(str(full), cfg, torch.float32, torch.device("cpu"))
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)


def test_the_head_refuses_a_missing_or_unexpected_tensor_by_name(tmp_path):
    path = write_mtp_checkpoint(tmp_path, "qwen", arch="qwen3_5", layers=4)
    tensors = load_file(path / "model.safetensors")
    cfg = registry.load_config(path)
    del tensors["mtp.layers.0.self_attn.k_norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor 'layers.0.self_attn.k_norm.weight'"):
        load_mtp_head(str(path), cfg, torch.float32, torch.device("cpu"))
    tensors["mtp.layers.0.self_attn.k_norm.weight"] = torch.ones(cfg.head_dim)
    tensors["mtp.layers.0.linear_attn.A_log"] = torch.zeros(4)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'layers.0.linear_attn.A_log'"):
        load_mtp_head(str(path), cfg, torch.float32, torch.device("cpu"))
