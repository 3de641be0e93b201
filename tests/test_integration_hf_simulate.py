"""M simulated workers of a transformers model in one process (stack_workers / stack_hf_workers).

What is mtdao's is fixed and tested here (keyword inputs reach every worker); what is
transformers' own is pinned as documented (a cache object cannot be stacked; SDPA's padding-mask
check branches on data, eager attention does not), so the docs stay true.
"""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch
from torch.testing import assert_close

import mtdao
from mtdao.sync import LocalUpdateSync, SimulatedWorkers, stack_workers, unified

M = 3


class KeywordModule(torch.nn.Module):
    """Takes its inputs by keyword, with a flag that is not a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, inputs, scale=None, negate=False):
        out = self.linear(inputs) * (1.0 if scale is None else scale)
        return -out if negate else out


def perturbed(workers) -> None:
    """Give each worker its own parameters, so that a mix-up between workers shows."""
    with torch.no_grad():
        for p in workers.parameters():
            p.add_(torch.randn_like(p) * 0.1)


def test_keyword_inputs_reach_each_worker_with_its_own_slice():
    torch.manual_seed(0)
    module = KeywordModule()
    workers = stack_workers(module, M)
    perturbed(workers)
    inputs, scale = torch.randn(M, 5, 4), torch.rand(M, 1)
    out = workers(inputs=inputs, scale=scale, negate=True)
    for w in range(M):
        params = {name: p[w] for name, p in workers.named_parameters()}
        expected = torch.func.functional_call(
            module, params, (), dict(inputs=inputs[w], scale=scale[w], negate=True)
        )
        assert_close(out[w], expected)


@pytest.fixture(scope="module")
def hf_imports() -> None:
    """transformers, imported once the first test that needs it runs, not at collection: every
    test process collects every file, and the import costs seconds of CPU."""
    global transformers, stack_hf_workers
    import transformers

    from mtdao.integrations.hf import stack_hf_workers


def needs_transformers(test):
    test = pytest.mark.usefixtures("hf_imports")(test)
    return pytest.mark.skipif(find_spec("transformers") is None, reason="needs the hf extra")(test)


def llama(**overrides):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        **overrides,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def gpt2(**overrides):
    config = transformers.GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        **overrides,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@needs_transformers
@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2"])
def test_each_simulated_worker_is_the_model_with_its_own_parameters(build):
    model = build()
    workers = stack_hf_workers(model, M)
    perturbed(workers)
    ids = torch.randint(0, 64, (M, 2, 16))
    out = workers(input_ids=ids, labels=ids)
    assert out.loss.shape == (M,)
    for w in range(M):
        params = {name: p[w] for name, p in workers.named_parameters()}
        single = torch.func.functional_call(
            model, params, (), dict(input_ids=ids[w], labels=ids[w])
        )
        assert_close(out.loss[w], single.loss)
        assert_close(out.logits[w], single.logits)


@needs_transformers
def test_simulated_hf_workers_train_and_agree_after_a_sync():
    workers = stack_hf_workers(llama(), M)
    optimizer = mtdao.MTAdam(workers.parameters(), lr=1e-2, betas=(0.99,), omegas=(0.9,))
    sync = LocalUpdateSync(optimizer, unified(4), SimulatedWorkers(M))
    ids = torch.randint(0, 64, (8, M, 2, 16))
    first = None
    for step in range(8):
        losses = workers(input_ids=ids[step], labels=ids[step]).loss
        first = losses.detach() if first is None else first
        losses.sum().backward()
        sync.step()
        optimizer.zero_grad()
        spread = max((p - p[:1]).abs().max().item() for p in workers.parameters())
        assert (spread == 0.0) == ((step + 1) % 4 == 0)  # workers differ only between syncs
    assert sync.traffic.rounds == 2


@needs_transformers
def test_a_cache_in_the_output_cannot_be_stacked_so_stack_hf_workers_turns_it_off():
    ids = torch.randint(0, 64, (M, 2, 16))
    with pytest.raises(ValueError, match="DynamicCache"):
        stack_workers(llama(use_cache=True), M)(input_ids=ids)
    model = llama(use_cache=True)
    stack_hf_workers(model, M)(input_ids=ids)
    assert model.config.use_cache is False


@needs_transformers
def test_padding_masks_need_eager_attention():
    """transformers' SDPA path asks ``padding_mask.all()`` (a data-dependent branch vmap
    refuses); its eager attention builds the mask arithmetically."""
    ids = torch.randint(0, 64, (M, 2, 16))
    mask = torch.ones_like(ids)
    mask[:, 1, :4] = 0
    with pytest.raises(RuntimeError, match="data-dependent control flow"):
        stack_hf_workers(llama(), M)(input_ids=ids, attention_mask=mask)
    model = llama(attn_implementation="eager")
    out = stack_hf_workers(model, M)(input_ids=ids, attention_mask=mask)
    assert_close(out.logits[1], model(input_ids=ids[1], attention_mask=mask[1]).logits)


@needs_transformers
def test_a_module_without_a_transformers_config_is_pointed_to_stack_workers():
    with pytest.raises(ValueError, match="use mtdao.sync.stack_workers"):
        stack_hf_workers(torch.nn.Linear(2, 2), M)
