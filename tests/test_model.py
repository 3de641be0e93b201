"""The Llama model: shapes, causality, vmap over stacked workers, presets, decay groups."""

import warnings

import pytest
import torch
from torch.func import functional_call, vmap

from mtdao.model import MODEL_PRESETS, Llama, ModelConfig, model_config, split_weight_decay

SMALL = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)


def test_forward_shape_and_finite():
    model = Llama(SMALL)
    logits = model(torch.randint(0, 61, (2, 16)))
    assert logits.shape == (2, 16, 61)
    assert torch.isfinite(logits).all()


def test_later_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    model = Llama(SMALL)
    tokens = torch.randint(0, 61, (1, 12))
    changed = tokens.clone()
    changed[0, 7] = (tokens[0, 7] + 1) % 61
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_rope_makes_attention_position_aware():
    # Without positions, a causal model maps "a b" and "b b" at the last position to the same
    # bag-of-tokens; RoPE must tell a shifted copy of a sequence from the original.
    torch.manual_seed(0)
    model = Llama(SMALL)
    tokens = torch.randint(0, 61, (1, 8))
    shifted = torch.cat([tokens[:, :1], tokens], dim=1)[:, :8]  # repeat first token
    assert not torch.allclose(model(tokens)[0, -1], model(shifted)[0, -1])


def test_tied_head_is_counted_once_and_untied_adds_a_matrix():
    tied, untied = Llama(SMALL), Llama(ModelConfig(**{**SMALL.__dict__, "tie_embeddings": False}))
    assert untied.num_parameters() - tied.num_parameters() == 61 * 32
    assert tied.num_parameters() == sum(p.numel() for _, p in tied.named_parameters())


def test_init_scales_residual_projections():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, d_model=256, n_layers=8, n_heads=4, max_seq_len=8)
    model = Llama(config)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    expected = 0.02 / (2 * config.n_layers) ** 0.5
    assert model.blocks[0].mlp.down_proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert torch.equal(model.final_norm.weight, torch.ones(256))


def test_vmapped_workers_match_separate_models():
    torch.manual_seed(0)
    num_workers = 3
    template = Llama(SMALL)
    workers = [Llama(SMALL) for _ in range(num_workers)]  # different params per worker
    stacked = {
        name: torch.stack([dict(w.named_parameters())[name].detach() for w in workers])
        .clone()
        .requires_grad_()
        for name, _ in template.named_parameters()
    }
    inputs = torch.randint(0, 61, (num_workers, 2, 16))
    targets = torch.randint(0, 61, (num_workers, 2, 16))

    with warnings.catch_warnings():  # CPU SDPA has no vmap batch rule yet; it loops instead
        warnings.simplefilter("ignore", UserWarning)
        logits = vmap(lambda p, x: functional_call(template, p, (x,)), in_dims=(0, 0))(
            stacked, inputs
        )
    losses = torch.nn.functional.cross_entropy(
        logits.flatten(1, 2).transpose(1, 2), targets.flatten(1), reduction="none"
    ).mean(1)
    losses.sum().backward()

    for index, worker in enumerate(workers):
        worker_logits = worker(inputs[index])
        torch.testing.assert_close(logits[index], worker_logits, atol=1e-5, rtol=1e-5)
        loss = torch.nn.functional.cross_entropy(
            worker_logits.flatten(0, 1), targets[index].flatten()
        )
        loss.backward()
        for name, param in worker.named_parameters():
            torch.testing.assert_close(stacked[name].grad[index], param.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vmapped", [False, True], ids=["one-model", "vmapped-workers"])
def test_bf16_autocast_forward_and_backward(vmapped):
    # what `--device cuda` runs by default (--bf16): RoPE's float32 tables once turned q and k
    # float32 beside a bf16 v, and attention refused them; CPU autocast takes the same path
    torch.manual_seed(0)
    model = Llama(SMALL)
    inputs = torch.randint(0, 61, (2, 2, 16))
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("ignore", UserWarning)
        if vmapped:
            stacked = {n: torch.stack([p.detach()] * 2).requires_grad_()
                       for n, p in model.named_parameters()}  # fmt: skip
            logits = vmap(lambda p, x: functional_call(model, p, (x,)))(stacked, inputs)
            grads = lambda: [p.grad for p in stacked.values()]  # noqa: E731
        else:
            logits = model(inputs[0])
            grads = lambda: [p.grad for p in model.parameters()]  # noqa: E731
    assert logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).mean().backward()
    assert all(g is not None and g.dtype == torch.float32 and g.isfinite().all() for g in grads())


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"d_model": 30}, "d_model"),
        ({"n_heads": 0}, "n_heads"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"d_model": 36, "n_heads": 4}, "n_heads"),  # head dim 9 is odd
        ({"d_ff": 0}, "d_ff"),
        ({"init_std": 0.0}, "init_std"),
    ],
)
def test_config_rejects_bad_fields(changes, field):
    fields = {**SMALL.__dict__, **changes}
    with pytest.raises(ValueError, match=field):
        ModelConfig(**fields)


def test_sequence_longer_than_rope_table_is_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        Llama(SMALL)(torch.zeros(1, 17, dtype=torch.long))


def test_presets_build_and_small_ones_have_stated_sizes():
    for preset in MODEL_PRESETS:
        assert model_config(preset, vocab_size=256, max_seq_len=128).vocab_size == 256
    tiny = Llama(model_config("tiny", 256, 256)).num_parameters()
    small = Llama(model_config("small", 256, 256)).num_parameters()
    assert 0.5e6 < tiny < 1.5e6
    assert 8e6 < small < 12e6
    with torch.device("meta"):
        paper_smallest = Llama(model_config("16m", 50257, 256)).num_parameters()
    assert 15e6 < paper_smallest < 17e6


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="micro, tiny, small"):
        model_config("huge", 256, 128)


def test_weight_decay_groups_cover_every_parameter_once():
    model = Llama(ModelConfig(**{**SMALL.__dict__, "tie_embeddings": False}))
    decay, no_decay = split_weight_decay(model.named_parameters(), weight_decay=0.1)
    all_names = [name for name, _ in model.named_parameters()]
    assert sorted(decay["names"] + no_decay["names"]) == sorted(all_names)
    assert set(decay["names"]).isdisjoint(no_decay["names"])
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert all(
        n.endswith("norm.weight") or n in ("embed.weight", "lm_head.weight")
        for n in no_decay["names"]
    )
    assert len(decay["names"]) == 5 * SMALL.n_layers
    # The same names with a stacked worker dim and a wrapper prefix land the same way.
    stacked = [(f"module.{n}", p.detach().unsqueeze(0)) for n, p in model.named_parameters()]
    stacked_decay, _ = split_weight_decay(stacked, weight_decay=0.1)
    assert stacked_decay["names"] == [f"module.{n}" for n in decay["names"]]
    torch.optim.AdamW(split_weight_decay(model.named_parameters(), 0.1), lr=1e-3)


def test_weight_decay_rejects_unknown_and_repeated_names():
    weight = torch.zeros(2)
    with pytest.raises(ValueError, match="'blocks.0.attn.bias' matches no"):
        split_weight_decay([("blocks.0.attn.bias", weight)], 0.1)
    with pytest.raises(ValueError, match="appears twice"):
        split_weight_decay([("embed.weight", weight), ("embed.weight", weight)], 0.1)
