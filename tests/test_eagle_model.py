"""EAGLE draft heads: paged forward, official checkpoint layouts, target aux features, errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import build_tiny_checkpoint
from pdserve.engine.attention import AttentionInputs
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.spec_decode.eagle import (
    EagleConfig,
    EagleDraftModel,
    build_eagle_head,
    load_eagle_model,
)
from pdserve.offline.eagle.features import load_target_model
from pdserve.offline.eagle.packed_attention import PackedCausalAttention

CPU = torch.device("cpu")
DRAFT_VOCAB = 64
AUX_IDS = [0, 1, 1]  # the tiny target has 2 layers


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    out = tmp_path_factory.mktemp("eagle-target")
    return out, build_tiny_checkpoint("llama", out)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir[0], 256)


def head_hf_config(target, layout: str) -> dict:
    t = target.cfg
    hf = {"hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
          "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
          "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": t.vocab_size,
          "rope_parameters": t.hf_config["rope_parameters"]}
    if layout == "eagle3":
        hf.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB,
                  eagle_aux_hidden_state_layer_ids=AUX_IDS)
    else:
        hf.update(architectures=["LlamaForCausalLM"])
    if layout == "eagle1-frspec":  # eagle1 + a frequency-ranked draft vocabulary
        hf.update(eagle_layout="eagle1", draft_vocab_size=DRAFT_VOCAB)
    return hf


def _random_vocab_map(vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    ids = torch.tensor(random.Random(seed).sample(range(vocab_size), DRAFT_VOCAB))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(DRAFT_VOCAB), "t2d": t2d}


def random_official_tensors(target, layout: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the official EAGLE checkpoint names (unfused projections)."""
    g = torch.Generator().manual_seed(seed)
    t = target.cfg
    H, I, D = t.hidden_size, t.intermediate_size, t.head_dim

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    def norm() -> torch.Tensor:
        return 1.0 + rnd(H)

    frspec = layout == "eagle1-frspec"
    layout = "eagle1" if frspec else layout
    pre = "layers.0." if layout == "eagle1" else "midlayer."
    qkv_in = H if layout == "eagle1" else 2 * H
    w = {
        f"{pre}self_attn.q_proj.weight": rnd(t.num_heads * D, qkv_in),
        f"{pre}self_attn.k_proj.weight": rnd(t.num_kv_heads * D, qkv_in),
        f"{pre}self_attn.v_proj.weight": rnd(t.num_kv_heads * D, qkv_in),
        f"{pre}self_attn.o_proj.weight": rnd(H, t.num_heads * D),
        f"{pre}mlp.gate_proj.weight": rnd(I, H),
        f"{pre}mlp.up_proj.weight": rnd(I, H),
        f"{pre}mlp.down_proj.weight": rnd(H, I),
        f"{pre}post_attention_layernorm.weight": norm(),
    }
    if layout == "eagle1":
        w.update({"fc.weight": rnd(H, 2 * H), "fc.bias": rnd(H),
                  "embed_tokens.weight": rnd(t.vocab_size, H)})  # shipped by EAGLE; ignored
        if frspec:
            w.update(_random_vocab_map(t.vocab_size, seed))
    else:
        ids = sorted(random.Random(seed).sample(range(t.vocab_size), DRAFT_VOCAB))
        target_ids = torch.tensor(ids)
        t2d = torch.zeros(t.vocab_size, dtype=torch.bool)
        t2d[target_ids] = True
        w.update({"fc.weight": rnd(H, 3 * H), f"{pre}hidden_norm.weight": norm(),
                  f"{pre}input_layernorm.weight": norm(), "norm.weight": norm(),
                  "lm_head.weight": rnd(DRAFT_VOCAB, H),
                  "d2t": target_ids - torch.arange(DRAFT_VOCAB), "t2d": t2d})
    return w


def write_head(folder: Path, hf: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def paged_forward_in_chunks(head: EagleDraftModel, ids: list[torch.Tensor],
                            first_hidden: list[torch.Tensor], chunks: list[int],
                            block_size: int = 4) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run two requests through the paged cache: prefill ``chunks``, then chained decodes.

    Returns each request's outputs and the hidden inputs actually used (prefill inputs,
    then each decode's input = the previous output).
    """
    num_blocks = 64
    shape = (num_blocks, block_size, head.num_kv_heads, head.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape))]
    tables = [list(range(0, 16)), list(range(16, 32))]
    outs: list[list[torch.Tensor]] = [[], []]
    used: list[list[torch.Tensor]] = [[], []]
    backend = head.layer.self_attn.backend

    def run(reqs: list[int], starts: list[int], lens: list[int], hidden: torch.Tensor,
            num_decodes: int) -> torch.Tensor:
        pos = [p for s, n in zip(starts, lens) for p in range(s, s + n)]
        slots = []
        for r, s, n in zip(reqs, starts, lens):
            slots += [tables[r][p // block_size] * block_size + p % block_size
                      for p in range(s, s + n)]
        tok = torch.cat([ids[r][s:s + n] for r, s, n in zip(reqs, starts, lens)])
        meta = backend.build_metadata(AttentionInputs(
            torch.tensor(slots), lens, [s + n for s, n in zip(starts, lens)],
            [tables[r] for r in reqs], num_decodes, block_size))
        return head(tok, hidden, torch.tensor(pos), kv, meta)

    start = 0
    for n in chunks:  # prefill chunks, both requests in one batch
        hidden = torch.cat([first_hidden[r][start:start + n] for r in (0, 1)])
        out = run([0, 1], [start, start], [n, n], hidden, 0)
        for r in (0, 1):
            outs[r].append(out[r * n:(r + 1) * n])
            used[r].append(hidden[r * n:(r + 1) * n])
        start += n
    for p in range(start, min(len(ids[0]), len(ids[1]))):  # chained decodes of both
        hidden = torch.cat([outs[0][-1][-1:], outs[1][-1][-1:]])
        out = run([0, 1], [p, p], [1, 1], hidden, 2)
        for r in (0, 1):
            outs[r].append(out[r:r + 1])
            used[r].append(hidden[r:r + 1])
    return [torch.cat(o) for o in outs], [torch.cat(u) for u in used]


@pytest.mark.parametrize("layout", ["eagle1", "eagle3"])
def test_paged_chunked_and_chained_forward_equals_dense_causal_forward(target, layout):
    cfg = EagleConfig.from_dict(head_hf_config(target, layout))
    torch.manual_seed(0)
    paged = build_eagle_head(cfg, target, TorchAttentionBackend(CPU), 256).eval()
    paged.load_weights(random_official_tensors(target, layout).items())
    dense = build_eagle_head(cfg, target, PackedCausalAttention(), 256).eval()
    dense.load_state_dict(paged.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 512, (30,), generator=g) for _ in range(2)]
    first_hidden = [torch.randn(30, cfg.hidden_size, generator=g) for _ in range(2)]

    with torch.no_grad():
        outs, used = paged_forward_in_chunks(paged, ids, first_hidden, chunks=[11, 6])
        for r in (0, 1):
            expected = dense(ids[r], used[r], torch.arange(30), [(None, None)],
                             dense.layer.self_attn.backend.build_metadata([30]))
            torch.testing.assert_close(outs[r], expected, rtol=1e-5, atol=1e-5)


def test_target_aux_features_are_the_transformers_layer_inputs(tiny_target_dir, target):
    _, hf_model = tiny_target_dir
    ids = torch.randint(0, 512, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf_model(ids, output_hidden_states=True).hidden_states
        hidden, aux = target(ids[0], torch.arange(17), [(None, None)] * 2,
                             PackedCausalAttention().build_metadata([17]), aux_layer_ids=(1, 0))
        plain = target(ids[0], torch.arange(17), [(None, None)] * 2,
                       PackedCausalAttention().build_metadata([17]))
    H = target.cfg.hidden_size
    torch.testing.assert_close(aux[:, :H], ref[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux[:, H:], ref[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, ref[-1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, plain)


def test_eagle3_checkpoint_loads_and_logits_are_finite_only_on_d2t_ids(target, tmp_path):
    tensors = random_official_tensors(target, "eagle3")
    folder = write_head(tmp_path / "eagle3", head_hf_config(target, "eagle3"), tensors)
    head = load_eagle_model(folder, target, TorchAttentionBackend(CPU), 256, torch.float32)
    assert head.cfg.layout == "eagle3" and head.aux_layer_ids == tuple(AUX_IDS)
    assert head.num_layers == 1 and head.num_kv_heads == target.cfg.num_kv_heads

    hidden = torch.randn(5, target.cfg.hidden_size)
    logits = head.compute_logits(hidden)
    assert logits.shape == (5, target.cfg.vocab_size) and logits.dtype == torch.float32
    mapped = torch.arange(DRAFT_VOCAB) + tensors["d2t"]
    finite = torch.isfinite(logits)
    assert finite[:, mapped].all()
    assert int(finite.sum()) == 5 * DRAFT_VOCAB
    assert torch.equal(finite[0], tensors["t2d"])
    # Draft logits land on their mapped target ids, computed by hand: lm_head(norm(h)).
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (normed * tensors["norm.weight"]) @ tensors["lm_head.weight"].T
    torch.testing.assert_close(logits[:, mapped], expected, rtol=1e-5, atol=1e-5)
    fused = head.combine_target_hidden(torch.ones(2, 3 * target.cfg.hidden_size))
    torch.testing.assert_close(fused, tensors["fc.weight"].sum(1).expand(2, -1))


def test_eagle1_checkpoint_skips_shipped_embedding_and_uses_target_lm_head(target, tmp_path):
    folder = write_head(tmp_path / "eagle1", head_hf_config(target, "eagle1"),
                        random_official_tensors(target, "eagle1"))
    head = load_eagle_model(folder, target, TorchAttentionBackend(CPU), 256, torch.float32)
    assert head.cfg.layout == "eagle1" and head.cfg.has_fc_bias
    assert not any("embed" in n or "lm_head" in n for n in head.state_dict())
    hidden = torch.randn(3, target.cfg.hidden_size)
    torch.testing.assert_close(head.compute_logits(hidden), hidden @ target.lm_head.weight.T)
    assert head.combine_target_hidden(hidden) is hidden


def test_eagle1_draft_vocabulary_drafts_only_its_ids_through_the_shared_lm_head(target,
                                                                                tmp_path):
    """FR-Spec on an eagle1 head: logits exist only on the d2t ids and are the target's LM
    head rows of those ids; the cheap path returns the same numbers unscattered."""
    tensors = random_official_tensors(target, "eagle1-frspec")
    folder = write_head(tmp_path / "frspec", head_hf_config(target, "eagle1-frspec"), tensors)
    head = load_eagle_model(folder, target, TorchAttentionBackend(CPU), 256, torch.float32)
    assert head.cfg.layout == "eagle1" and head.has_draft_vocab
    ids = torch.arange(DRAFT_VOCAB) + tensors["d2t"]
    assert torch.equal(head.draft_token_ids(), ids)
    hidden = torch.randn(4, target.cfg.hidden_size)
    logits = head.compute_logits(hidden)
    assert int(torch.isfinite(logits).sum()) == 4 * DRAFT_VOCAB
    expected = hidden @ target.lm_head.weight[ids].T
    torch.testing.assert_close(logits[:, ids], expected)
    small, small_ids = head.compute_draft_logits(hidden)
    assert small.shape == (4, DRAFT_VOCAB) and torch.equal(small_ids, ids)
    torch.testing.assert_close(small, expected)
    # the greedy draft is the target's argmax restricted to the draft ids
    assert torch.equal(small_ids[small.argmax(-1)], logits.argmax(-1))


def test_draft_vocabulary_without_its_map_or_with_duplicates_is_rejected(target, tmp_path):
    tensors = random_official_tensors(target, "eagle1-frspec")
    hf = head_hf_config(target, "eagle1-frspec")
    no_map = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    with pytest.raises(ValueError, match="no 'd2t' map"):
        load_eagle_model(write_head(tmp_path / "a", hf, no_map), target,
                         TorchAttentionBackend(CPU), 256, torch.float32)
    dup = dict(tensors, d2t=-torch.arange(DRAFT_VOCAB))  # every draft id -> target id 0
    with pytest.raises(ValueError, match="same target id"):
        load_eagle_model(write_head(tmp_path / "b", hf, dup), target,
                         TorchAttentionBackend(CPU), 256, torch.float32)


def test_missing_folder_is_a_clear_file_not_found(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_eagle_model(tmp_path / "nope", target, TorchAttentionBackend(CPU), 256,
                         torch.float32)


def test_folder_without_weights_is_a_clear_file_not_found(target, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(head_hf_config(target, "eagle1")))
    with pytest.raises(FileNotFoundError, match="has no weights"):
        load_eagle_model(tmp_path, target, TorchAttentionBackend(CPU), 256, torch.float32)


def test_wrong_tensor_shape_names_the_tensor(target, tmp_path):
    tensors = random_official_tensors(target, "eagle3")
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1].contiguous()
    folder = write_head(tmp_path / "bad", head_hf_config(target, "eagle3"), tensors)
    with pytest.raises(ValueError, match=r"'fc.weight' has shape"):
        load_eagle_model(folder, target, TorchAttentionBackend(CPU), 256, torch.float32)


def test_config_without_hidden_size_names_the_field(target):
    hf = head_hf_config(target, "eagle1")
    del hf["hidden_size"]
    with pytest.raises(ValueError, match="'hidden_size'"):
        EagleConfig.from_dict(hf)


def test_head_wider_than_the_target_is_rejected(target):
    hf = head_hf_config(target, "eagle1")
    hf["hidden_size"] = 2 * target.cfg.hidden_size
    with pytest.raises(ValueError, match="hidden_size"):
        build_eagle_head(EagleConfig.from_dict(hf), target, TorchAttentionBackend(CPU), 256)
