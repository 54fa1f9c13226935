"""EAGLE head training: self-distillation on a tiny random Llama, saving, reloading, CLI errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import build_tiny_checkpoint
from pdserve.cli import main
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.spec_decode.eagle import load_eagle_model
from pdserve.offline.eagle.acceptance import estimate_acceptance
from pdserve.offline.eagle.data import DistillSequence, detag_sentence
from pdserve.offline.eagle.features import compute_target_features, load_target_model
from pdserve.offline.eagle.trainer import TrainHyperParams, train_head
from pdserve.offline.eagle.packed_attention import PackedCausalAttention
from pdserve.offline.eagle.train import new_head, save_head

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("train-eagle-target")
    build_tiny_checkpoint("llama", out)
    return out


@pytest.fixture(scope="module")
def distilled(tiny_dir):
    """Greedy answers of the tiny target (our engine) to random prompts, with features."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (12,), generator=g).tolist() for _ in range(8)]
    llm = LLM(str(tiny_dir), dtype="float32", load_progress=False, num_kv_blocks=128)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16),
                        detokenize=False)
    seqs = [DistillSequence(p, list(o.outputs[0].token_ids), i >= 6)
            for i, (p, o) in enumerate(zip(prompts, outs))]
    target = load_target_model(tiny_dir, 64)
    return target, compute_target_features(target, seqs, use_tqdm=False)


def test_training_lowers_the_loss(distilled):
    target, data = distilled
    torch.manual_seed(0)
    head = new_head(target, "cpu", 64, PackedCausalAttention())
    hp = TrainHyperParams(epochs=20, lr=3e-3, batch_tokens=1000, warmup_fraction=0.1,
                          unroll_steps=2)
    history = train_head(head, [d for d in data if not d.is_held_out], hp, use_tqdm=False)
    assert history.num_steps == 20
    first, last = history.losses[:5], history.losses[-5:]
    assert sum(last) / 5 < 0.8 * sum(first) / 5


def test_token_only_training_ignores_the_feature_loss(distilled):
    """--regression-weight 0 (EAGLE-3's training): the loss is the classification loss alone,
    yet the feature loss is still reported; and it still learns the target's tokens."""
    target, data = distilled
    train = [d for d in data if not d.is_held_out]
    torch.manual_seed(0)
    head = new_head(target, "cpu", 64, PackedCausalAttention())
    hp = TrainHyperParams(epochs=20, lr=3e-3, batch_tokens=1000, warmup_fraction=0.1,
                          unroll_steps=2, reg_weight=0.0, cls_weight=1.0)
    history = train_head(head, train, hp, use_tqdm=False)
    assert history.losses == pytest.approx(history.cls_losses, rel=1e-5)
    assert all(r > 0 for r in history.reg_losses)
    assert sum(history.cls_losses[-5:]) < 0.8 * sum(history.cls_losses[:5])


@pytest.mark.parametrize("kwargs", [{"reg_weight": -1.0}, {"cls_weight": 0.0, "reg_weight": 0.0}])
def test_bad_loss_weights_are_refused(kwargs):
    with pytest.raises(ValueError, match="weight"):
        TrainHyperParams(**kwargs)


def test_saved_head_reloads_with_the_same_outputs(distilled, tmp_path):
    target, data = distilled
    torch.manual_seed(0)
    head = new_head(target, "cpu", 64, PackedCausalAttention())
    train_head(head, data[:4], TrainHyperParams(epochs=1, batch_tokens=80), use_tqdm=False)
    save_head(head, tmp_path, {"note": "test"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eagle_layout"] == "eagle1" and config["pdserve_provenance"] == {"note": "test"}
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask

    loaded = load_eagle_model(tmp_path, target, TorchAttentionBackend(CPU), 64, torch.float32)
    for name, value in loaded.state_dict().items():  # saved in bf16
        torch.testing.assert_close(value, head.state_dict()[name].bfloat16().float())
    estimate = estimate_acceptance(loaded, data[6:], num_speculative_tokens=4)
    assert 1.0 <= estimate.mean_acceptance_length <= 5.0
    assert len(estimate.acceptance_rates) == 4 and estimate.num_starts > 0


def test_head_with_a_frequency_ranked_draft_vocabulary_trains_saves_and_reloads(distilled,
                                                                               tmp_path):
    from pdserve.offline.eagle.data import DistillSequence as Seq
    from pdserve.offline.eagle.train import frequent_token_ids

    target, data = distilled
    vocab = target.cfg.vocab_size
    seqs = [Seq(d.token_ids[:d.num_prompt_tokens].tolist(),
                d.token_ids[d.num_prompt_tokens:].tolist(), d.is_held_out) for d in data]
    ids, coverage = frequent_token_ids(seqs[:6], 32, vocab)
    answers = torch.tensor([t for s in seqs[:6] for t in s.answer_ids])
    counts = torch.bincount(answers, minlength=vocab)
    assert len(ids.unique()) == 32 and counts[ids[0]] == counts.max()
    assert (counts[ids[:-1]] >= counts[ids[1:]]).all()  # most frequent first
    assert coverage == pytest.approx(float(counts[ids].sum()) / len(answers))

    torch.manual_seed(0)
    head = new_head(target, "cpu", 64, PackedCausalAttention(), ids)
    assert torch.equal(head.draft_token_ids(), ids)
    history = train_head(head, data[:6], TrainHyperParams(epochs=4, batch_tokens=80),
                         use_tqdm=False)
    assert history.loss_vocab_size == 32 and all(torch.isfinite(torch.tensor(history.losses)))
    save_head(head, tmp_path, {})
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 32
    loaded = load_eagle_model(tmp_path, target, TorchAttentionBackend(CPU), 64, torch.float32)
    assert torch.equal(loaded.draft_token_ids(), ids)  # int64 map survives the bf16 save
    logits = loaded.compute_logits(torch.randn(3, target.cfg.hidden_size))
    assert torch.isfinite(logits).sum() == 3 * 32 and torch.isfinite(logits[:, ids]).all()


def test_a_narrow_head_widens_without_changing_its_drafts(distilled, tmp_path):
    """--init-from a head with a narrower MLP: same drafts before training (saved weights are
    bf16, so both heads are compared from the same saved file), then the new units learn."""
    from pdserve.offline.eagle.train import load_init_weights

    target, data = distilled
    width = target.cfg.intermediate_size
    torch.manual_seed(0)
    narrow = new_head(target, "cpu", 64, PackedCausalAttention())
    train_head(narrow, data[:4], TrainHyperParams(epochs=1, batch_tokens=80), use_tqdm=False)
    save_head(narrow, tmp_path / "narrow", {})
    narrow = new_head(target, "cpu", 64, PackedCausalAttention())
    load_init_weights(narrow, tmp_path / "narrow")
    wide = new_head(target, "cpu", 64, PackedCausalAttention(), intermediate_size=2 * width)
    load_init_weights(wide, tmp_path / "narrow")
    assert wide.layer.mlp.gate_up_proj.weight.shape[0] == 4 * width
    down = wide.layer.mlp.down_proj.weight
    assert down[:, width:].abs().sum() == 0 and down[:, :width].abs().sum() > 0
    seq = data[6]
    n = len(seq.token_ids) - 1
    outs = [h(seq.token_ids[1:], seq.features[:-1], torch.arange(n), [(None, None)],
              h.layer.self_attn.backend.build_metadata([n])) for h in (narrow, wide)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)

    train_head(wide, data[:6], TrainHyperParams(epochs=2, batch_tokens=80), use_tqdm=False)
    assert wide.layer.mlp.down_proj.weight[:, width:].abs().sum() > 0
    save_head(wide, tmp_path / "wide", {})
    config = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert config["intermediate_size"] == 2 * width
    load_eagle_model(tmp_path / "wide", target, TorchAttentionBackend(CPU), 64, torch.float32)
    with pytest.raises(ValueError, match="cannot be narrowed"):
        load_init_weights(new_head(target, "cpu", 64, PackedCausalAttention(),
                                   intermediate_size=width // 2), tmp_path / "wide")


def test_eagle3_head_trains_on_fused_features_saves_reloads_and_drafts_losslessly(
        tiny_dir, distilled, tmp_path):
    """--head-layout eagle3: features are the fused layer inputs (bf16), the head starts from
    the target's norm and LM head rows, learns the target's tokens without feature
    regression, saves under official EAGLE-3 names and serves greedy output unchanged."""
    from pdserve.offline.eagle.data import DistillSequence as Seq
    from pdserve.offline.eagle.train import frequent_token_ids

    target, data = distilled
    aux = (0, 1, 1)  # the tiny target has 2 layers
    seqs = [Seq(d.token_ids[:d.num_prompt_tokens].tolist(),
                d.token_ids[d.num_prompt_tokens:].tolist(), d.is_held_out) for d in data]
    fused = compute_target_features(target, seqs, use_tqdm=False, aux_layer_ids=aux)
    hidden = target.cfg.hidden_size
    seq = fused[0]
    assert seq.features.dtype == torch.bfloat16
    assert seq.features.shape == (len(seq.token_ids), 3 * hidden)
    n = len(seq.token_ids)
    _, want = target(seq.token_ids, torch.arange(n), [(None, None)] * 2,
                     target.model.layers[0].self_attn.backend.build_metadata([n]), aux)
    torch.testing.assert_close(seq.features.float(), want.bfloat16().float())
    assert torch.equal(seq.teacher_ids, data[0].teacher_ids)

    ids, _ = frequent_token_ids(seqs[:6], 64, target.cfg.vocab_size)
    torch.manual_seed(0)
    head = new_head(target, "cpu", 64, PackedCausalAttention(), ids, layout="eagle3",
                    aux_layer_ids=aux)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[ids])
    assert torch.equal(head.draft_token_ids(), ids)
    assert torch.equal(head.combine_target_hidden(seq.features.float())[:, :],
                       seq.features.float()[:, 2 * hidden:])
    hp = TrainHyperParams(epochs=30, lr=3e-3, batch_tokens=1000, warmup_fraction=0.1,
                          unroll_steps=2, reg_weight=0.0, cls_weight=1.0)
    history = train_head(head, fused[:6], hp, use_tqdm=False)
    assert history.loss_vocab_size == 64 and history.reg_losses == [0.0] * history.num_steps
    assert sum(history.cls_losses[-5:]) < 0.7 * sum(history.cls_losses[:5])

    out = tmp_path / "eagle3"
    save_head(head, out, {"note": "test"})
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_layout"] == "eagle3" and config["architectures"] == [
        "LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    assert config["draft_vocab_size"] == 64
    loaded = load_eagle_model(out, target, TorchAttentionBackend(CPU), 64, torch.float32)
    assert loaded.aux_layer_ids == aux and torch.equal(loaded.draft_token_ids(), ids)
    for name, value in loaded.state_dict().items():
        expected = head.state_dict()[name]
        torch.testing.assert_close(value, expected.bfloat16().to(value.dtype)
                                   if expected.is_floating_point() else expected)
    untrained = new_head(target, "cpu", 64, TorchAttentionBackend(CPU), ids, layout="eagle3",
                         aux_layer_ids=aux)
    trained_al = estimate_acceptance(loaded, fused[:6], 4).mean_acceptance_length
    assert trained_al > estimate_acceptance(untrained, fused[:6], 4).mean_acceptance_length

    prompts = [d.token_ids[:d.num_prompt_tokens].tolist() for d in data]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    plain = LLM(str(tiny_dir), dtype="float32", load_progress=False, num_kv_blocks=128)
    spec = LLM(str(tiny_dir), dtype="float32", load_progress=False, num_kv_blocks=128,
               speculative_method="eagle", speculative_model=str(out), num_speculative_tokens=3,
               speculative_disable_by_batch_size=0)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, detokenize=False)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params,
                                                                  detokenize=False)]
    assert spec.engine.spec_stats.num_accepted_tokens > 0


def test_an_eagle1_head_cannot_start_an_eagle3_run(tiny_dir, tmp_path, capsys):
    target = load_target_model(tiny_dir, 64)
    save_head(new_head(target, "cpu", 64, PackedCausalAttention()), tmp_path / "h1", {})
    code = main(["train-eagle", "--model", str(tiny_dir), "--out", str(tmp_path / "o"),
                 "--head-layout", "eagle3", "--aux-layers", "0,1,1",
                 "--init-from", str(tmp_path / "h1")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is not an EAGLE-3 head" in err and "holds an eagle1 head" in err
    with pytest.raises(SystemExit):
        main(["train-eagle", "--model", str(tiny_dir), "--out", str(tmp_path / "o"),
              "--aux-layers", "1,2"])
    assert "expected three non-negative layer ids" in capsys.readouterr().err


def test_init_head_wider_than_the_asked_width_is_refused_before_any_work(tiny_dir, tmp_path,
                                                                         capsys):
    target = load_target_model(tiny_dir, 64)
    width = target.cfg.intermediate_size
    save_head(new_head(target, "cpu", 64, PackedCausalAttention(), intermediate_size=2 * width),
              tmp_path / "wide", {})
    code = main(["train-eagle", "--model", str(tiny_dir), "--out", str(tmp_path / "o"),
                 "--init-from", str(tmp_path / "wide"), "--head-intermediate-size", str(width)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert (f"--head-intermediate-size {width} is narrower than the --init-from head's MLP "
            f"({2 * width})") in err
    assert not (tmp_path / "o").exists()


def test_a_continued_head_keeps_its_width_and_fused_layers_unless_told(tiny_dir, tmp_path):
    """``--init-from`` without ``--head-intermediate-size`` / ``--aux-layers`` trains at the
    init head's MLP width and fuses its layers; other fused layers are refused."""
    from pdserve.offline.eagle.train_config import TrainEagleConfig, check_fits_target

    target = load_target_model(tiny_dir, 64)
    width = target.cfg.intermediate_size
    save_head(new_head(target, "cpu", 64, PackedCausalAttention(), torch.arange(64),
                       2 * width, "eagle3", (0, 1, 1)), tmp_path / "h3", {})

    def fits(**kw):
        cfg = TrainEagleConfig(model=str(tiny_dir), data="builtin", out=tmp_path / "o",
                               layout="eagle3", init_from=tmp_path / "h3", **kw)
        return check_fits_target(cfg, tiny_dir)

    assert fits() == (2 * width, (0, 1, 1))
    assert fits(head_intermediate_size=4 * width, aux_layer_ids=(0, 1, 1)) == (4 * width,
                                                                              (0, 1, 1))
    with pytest.raises(ValueError, match=r"aux_layer_ids \[0, 1, 0\] differ from the layers "
                                         r"the init_from head fuses \(\[0, 1, 1\]\)"):
        fits(aux_layer_ids=(0, 1, 0))


def test_brown_tags_are_removed_and_quotes_attached():
    tagged = "The/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, again/rb ./."
    assert detag_sentence(tagged) == 'The jury said "no evidence", again.'


@pytest.mark.parametrize("argv, message", [
    (["--data", "/nonexistent/text.txt"], "does not exist"),
    # errors name the flags, not the config fields
    (["--epochs", "0"], "--epochs must be positive, got 0"),
    (["--num-prompts", "-3"], "--num-prompts must be positive, got -3"),
    (["--classification-weight", "0", "--regression-weight", "0"],
     "--classification-weight and --regression-weight are both 0: nothing to train on"),
    (["--aux-layers", "1,2,3"],
     "--aux-layers apply to eagle3 heads only (the fused target layers), not layout 'eagle1'"),
    (["--init-from", "/nonexistent/head"], "--init-from '/nonexistent/head' does not exist"),
    (["--init-from", "/"], "--init-from '/' is not an EAGLE head folder"),
    # checked against the target before any answer is generated
    (["--head-layout", "eagle3", "--aux-layers", "0,1,5"],
     "--aux-layers [0, 1, 5] are not layers of the target (0 .. 1)"),
    (["--init-from", "default"], "is a head for a target of hidden size 576, not this target (64)"),
    # 0 is allowed (the whole vocabulary), so the message is not "must be positive"
    (["--draft-vocab-size", "-5"],
     "--draft-vocab-size must be >= 0 (0: the whole vocabulary), got -5"),
])
def test_cli_bad_input_is_a_one_line_error(tiny_dir, tmp_path, capsys, argv, message):
    code = main(["train-eagle", "--model", str(tiny_dir), "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_refuses_an_out_folder_it_would_spoil_and_data_that_is_not_text(
        tiny_dir, tmp_path, capsys):
    """Before any work: an ``--out`` folder holding other files (a model, notes) is refused,
    as is one under a file; ``--data`` that is a folder, not UTF-8 or binary is refused; a
    head folder may be retrained in place. Nothing is written into a refused folder."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Caf\xe9 au lait. Cr\xe8me br\xfbl\xe9e.\n\nAnother paragraph here.".encode(
        "latin-1"))
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"one two three\x00four\n\nfive six seven.")
    cases = [
        (["--out", str(notes)], "is a folder with other files in it"),
        (["--out", str(tiny_dir)], "is a folder with other files in it"),  # a model folder
        (["--out", str(a_file / "sub")], f"{str(a_file)!r} is a file"),
        (["--out", str(dangling)], "is a symbolic link to nothing"),
        (["--out", ""], "out must name a folder"),
        (["--out", "/proc/pdserve-test/head"], "cannot be written"),
        (["--out", str(tmp_path / "o"), "--data", str(tmp_path)], "is a folder, not a text file"),
        (["--out", str(tmp_path / "o"), "--data", str(latin1)], "is not UTF-8 text (byte 3"),
        (["--out", str(tmp_path / "o"), "--data", str(nul)], "holds NUL bytes"),
        (["--out", str(tmp_path / "o"), "--init-from", str(tiny_dir)], "is not an EAGLE-1 head"),
        (["--out", str(tmp_path / "o"), "--device", "cuda:x"], "device must be 'cpu' or"),
    ]
    for argv, message in cases:
        code = main(["train-eagle", "--model", str(tiny_dir), *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2, argv
        assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in notes.iterdir()) == ["todo.txt"]
    assert not (tmp_path / "o").exists()
    head = tmp_path / "head"
    torch.manual_seed(0)
    target = load_target_model(tiny_dir, 64)
    save_head(new_head(target, "cpu", 64, PackedCausalAttention()), head, {})
    (head / "notes.txt").write_text("a head folder with notes is still a head")
    from pdserve.offline.eagle.train import TrainEagleConfig

    TrainEagleConfig(model=str(tiny_dir), data="builtin", out=head)  # no error


def test_cli_missing_model_is_a_one_line_error(tmp_path, capsys):
    code = main(["train-eagle", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "not found" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("value", ["abc", "5:", ":5", "3:0", "0", "-1", "3:4:5"])
def test_cli_bad_extra_self_written_round_is_refused(tiny_dir, tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["train-eagle", "--model", str(tiny_dir), "--out", str(tmp_path / "o"),
              "--extra-self-written", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert f"expected COUNT or COUNT:MAX_ANSWER_TOKENS, both positive integers, got {value!r}" in err


@pytest.mark.parametrize("bad", ["{", '{"a": 1}', "[]", '["ok", 3]', '["ok", ""]',
                                 '["a", "b", "c", "d"]', b"\xff\xfe"])
def testcached_requests_are_reused_and_a_bad_file_is_written_again(tmp_path, bad):
    from pdserve.offline.eagle.train import cached_requests

    answers = tmp_path / "k.self-written.jsonl"
    calls, logged = [], []

    def write():
        calls.append(1)
        return ["Explain tides.", "Name a river."]

    assert cached_requests(answers, 3, write, logged.append) == ["Explain tides.", "Name a river."]
    cache = tmp_path / "k.self-written.requests.json"
    assert json.loads(cache.read_text()) == ["Explain tides.", "Name a river."]
    assert cached_requests(answers, 3, write, logged.append) == ["Explain tides.", "Name a river."]
    assert len(calls) == 1 and not logged  # the second call read the file
    cache.write_bytes(bad if isinstance(bad, bytes) else bad.encode())
    assert cached_requests(answers, 3, write, logged.append) == ["Explain tides.", "Name a river."]
    assert len(calls) == 2 and len(logged) == 1 and str(cache) in logged[0]
    assert json.loads(cache.read_text()) == ["Explain tides.", "Name a river."]
