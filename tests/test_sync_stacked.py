"""stack_workers: any module as M simulated workers; and the test doubles of mtdao.sync.testing."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from fixed_order_matmuls import FixedOrderMatmuls
from torch import nn
from torch.func import functional_call
from torch.testing import assert_close

from mtdao.model import Llama, ModelConfig
from mtdao.sync import LocalUpdateSync, SimulatedWorkers, stack_workers, unified
from mtdao.sync.testing import PeerFailure, RecordingCommunicator, ScriptedCommunicator

WORKERS = 3


class TiedModel(nn.Module):
    """An embedding whose weight the output layer shares, a norm, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("offset", torch.arange(6.0) / 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens) + self.offset))


def perturbed_workers():
    torch.manual_seed(0)
    model = TiedModel()
    workers = stack_workers(model, WORKERS)
    with torch.no_grad():
        for p in workers.parameters():
            p.add_(0.1 * torch.randn_like(p))  # every worker somewhere else
    return model, workers


def worker_copy(model: nn.Module, workers, w: int) -> dict[str, torch.Tensor]:
    return {name: p[w] for name, p in workers.named_parameters()}


def test_stacked_parameters_keep_names_shapes_and_ties():
    model = TiedModel()
    workers = stack_workers(model, WORKERS)
    names = [name for name, _ in model.named_parameters()]
    assert [name for name, _ in workers.named_parameters()] == names  # tied head: not repeated
    for (_, stacked), (_, p) in zip(workers.named_parameters(), model.named_parameters()):
        assert stacked.shape == (WORKERS, *p.shape)
        assert all(torch.equal(stacked[w], p) for w in range(WORKERS))
    assert set(workers.state_dict()) == set(model.state_dict()) - {"head.weight"}


def test_forward_and_losses_run_each_worker_on_its_own_inputs():
    model, workers = perturbed_workers()
    tokens = torch.randint(0, 11, (WORKERS, 4, 5))
    targets = torch.randint(0, 11, (WORKERS, 4, 5))
    outputs = workers(tokens)
    assert outputs.shape == (WORKERS, 4, 5, 11)

    def loss_fn(logits, targets):
        return nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))

    losses = workers.losses(loss_fn, tokens, targets)
    losses.sum().backward()
    for w in range(WORKERS):
        params = {k: v.detach().requires_grad_() for k, v in worker_copy(model, workers, w).items()}
        alone = functional_call(model, params, (tokens[w],))
        assert_close(outputs[w], alone)
        loss = loss_fn(alone, targets[w])
        assert_close(losses[w], loss)
        loss.backward()
        for name, p in workers.named_parameters():  # each slice holds that worker's gradient
            assert_close(p.grad[w], params[name].grad)


def test_average_is_the_module_at_the_mean_parameters():
    model, workers = perturbed_workers()
    average = workers.average()
    assert average is not model
    for (name, p), (_, stacked) in zip(average.named_parameters(), workers.named_parameters()):
        assert_close(p, stacked.mean(0)), name
    assert average.head.weight is average.embed.weight


def test_stacked_workers_train_with_the_engine_and_stay_in_step():
    _, workers = perturbed_workers()
    optimizer = torch.optim.AdamW(workers.parameters(), lr=1e-2)
    sync = LocalUpdateSync(optimizer, unified(2), SimulatedWorkers(WORKERS))  # broadcasts worker 0
    for step in range(4):
        tokens = torch.randint(
            0, 11, (WORKERS, 4, 5), generator=torch.Generator().manual_seed(step)
        )
        workers(tokens).square().mean(dim=(1, 2, 3)).sum().backward()
        sync.step()
        optimizer.zero_grad()
    for p in workers.parameters():  # step 4 ended a round: every worker holds the average
        assert all(torch.equal(p[0], p[w]) for w in range(WORKERS))


def test_an_unstacked_tensor_is_refused_with_the_way_out():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(64, 16))], lr=0.1)
    with pytest.raises(ValueError, match="leading worker dimension of 4.*stack_workers"):
        LocalUpdateSync(optimizer, unified(2), SimulatedWorkers(4))


@pytest.mark.parametrize("count", [0, -1, True, 2.0])
def test_a_bad_number_of_workers_is_refused_as_the_simulator_refuses_it(count):
    for build in (lambda: stack_workers(nn.Linear(2, 2), count), lambda: SimulatedWorkers(count)):
        with pytest.raises(
            ValueError, match=rf"^Invalid number of workers: {count} \(must be >= 1\)$"
        ):
            build()


class CountedModel(TiedModel):
    """TiedModel counting its forward calls: under vmap, one per vmapped call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(tokens)


def small_llama() -> nn.Module:
    config = ModelConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2, max_seq_len=5)
    return Llama(config)


@pytest.mark.exact
@pytest.mark.parametrize("make_model", [CountedModel, small_llama], ids=["tied", "llama"])
def test_workers_per_call_chunks_the_workers_and_changes_no_result_bit_for_bit(
    make_model, one_thread
):
    """Bit for bit by construction: every op computes each worker's slice in an order that does
    not depend on the other workers of its call. torch's own kernels do (on one thread); a BLAS
    matrix product need not (MKL picks its kernel by CPU and batch size), so the products here
    sum in a fixed order (FixedOrderMatmuls)."""
    num_workers = 7  # chunks of 1, 3 (the last one short) and 4 (the last one short), or all
    torch.manual_seed(0)
    model = make_model()
    tokens = torch.randint(0, 11, (num_workers, 4, 5))
    targets = torch.randint(0, 11, (num_workers, 4, 5))
    perturbation = {
        n: 0.1 * torch.randn(num_workers, *p.shape) for n, p in model.named_parameters()
    }

    def run(workers_per_call):
        workers = stack_workers(model, num_workers, workers_per_call=workers_per_call)
        with torch.no_grad():
            for name, p in workers.named_parameters():
                p.add_(perturbation[name])
        model.calls = 0
        outputs = workers(tokens)
        losses = workers.losses(
            lambda logits, t: nn.functional.cross_entropy(logits.reshape(-1, 11), t.reshape(-1)),
            tokens,
            targets,
        )
        losses.sum().backward()
        grads = [p.grad for p in workers.parameters()]
        return outputs, losses, grads, model.calls

    fixed_order = FixedOrderMatmuls()
    with fixed_order:
        outputs, losses, grads, _ = run(None)
    assert fixed_order.products > 0
    for workers_per_call, calls in ((1, 7), (3, 3), (4, 2), (7, 1), (8, 1)):
        with FixedOrderMatmuls():
            chunked = run(workers_per_call)
        assert torch.equal(chunked[0], outputs) and torch.equal(chunked[1], losses)
        assert all(torch.equal(a, b) for a, b in zip(chunked[2], grads))
        if isinstance(model, CountedModel):
            assert chunked[3] == 2 * calls, workers_per_call  # the forward and the losses


@pytest.mark.parametrize("value", [0, -2, True, 2.5, "8"])
def test_a_bad_number_of_workers_per_call_is_refused(value):
    with pytest.raises(ValueError, match=r"^Invalid workers per call: .*must be an int >= 1"):
        stack_workers(nn.Linear(2, 2), 4, workers_per_call=value)


def test_stacking_a_model_imports_nothing_of_the_sync_package():
    """The model side of simulated workers lives with the models; only mtdao.sync re-exports it."""
    code = (
        "import sys; import mtdao.model.stacked_workers; "
        "print([m for m in sys.modules if m.startswith('mtdao.sync')])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# -- the test doubles -----------------------------------------------------------------------------


def test_recording_communicator_forwards_to_a_real_one_and_logs_every_call():
    inner = SimulatedWorkers(2)
    recording = RecordingCommunicator(inner)
    param = nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
    sync = LocalUpdateSync(torch.optim.SGD([param], lr=0.0), unified(1), recording)
    param.grad = torch.zeros_like(param)
    sync.step()
    assert [call.method for call in recording.calls] == [
        "broadcast_from_first",
        "average",
        "commit",
        "assign",
    ]
    assert recording.average_kinds() == [["params"]]
    assert recording.calls[1].shapes == [(2, 2)]
    assert recording.traffic is inner.traffic and inner.traffic.bytes == 8
    assert torch.equal(param, torch.tensor([[1.0, 2.0], [1.0, 2.0]]))  # worker 0 broadcast


def test_scripted_communicator_returns_its_script_then_fails_where_told():
    param = nn.Parameter(torch.tensor([1.0, 2.0]))
    scripted = ScriptedCommunicator([lambda tensors: [t * 10 for t in tensors]], fail_at=3)
    sync = LocalUpdateSync(torch.optim.SGD([param], lr=0.0), unified(1), scripted)
    param.grad = torch.zeros_like(param)
    sync.step()
    assert torch.equal(param.detach(), torch.tensor([10.0, 20.0]))  # scripted
    sync.step()
    assert torch.equal(param.detach(), torch.tensor([10.0, 20.0]))  # past the script: identity
    with pytest.raises(PeerFailure, match="average call 3"):
        sync.step()
    custom = ScriptedCommunicator(fail_at=1, error=TimeoutError("quorum lost"))
    with pytest.raises(TimeoutError, match="quorum lost"):
        LocalUpdateSync(torch.optim.SGD([copy.deepcopy(param)], lr=0.0), unified(1), custom).step()
