"""The torchft communicator with replicas as threads of this process (a lighthouse in-process,
gloo on loopback): equal to simulated workers for every kind of round, healing of a late
replica to the group's exact state, the NaN guard across replicas, and the refusals."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from wait_limits import limit_s

from mtdao import MTAdam
from mtdao.sync import (
    LocalUpdateSync,
    NonFiniteError,
    OuterOptimizerConfig,
    SimulatedWorkers,
    desloc,
    explicit,
    gradient_averaging,
    half_life_policy,
    unified,
)
from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.communicator import RoundNotCommitted
from mtdao.sync.process_group import ProcessGroupWorkers
from mtdao.sync.testing import run_on_gloo

pytest.importorskip("torchft")
import mtdao.ft as torchft  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

D_IN, D_OUT = 4, 3
TIMEOUTS = dict(connect_timeout=5, quorum_timeout=30, collective_timeout=10)  # each replica's


def initial(replica: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + replica)  # replicas start apart: the first quorum
    return [  # makes them all replica 0
        torch.randn(D_OUT, D_IN, generator=gen, dtype=torch.float64),
        torch.randn(D_OUT, generator=gen, dtype=torch.float64),
    ]


def data(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * replica + step)
    inputs = torch.randn(8, D_IN, generator=gen, dtype=torch.float64)
    return inputs, torch.randn(8, D_OUT, generator=gen, dtype=torch.float64)


def loss(weight, bias, inputs, targets) -> torch.Tensor:
    prediction = torch.einsum("...nd,...od->...no", inputs, weight) + bias.unsqueeze(-2)
    return 0.5 * (prediction - targets).square().mean(dim=(-2, -1)).sum()


def optimizer_for(params) -> MTAdam:
    return MTAdam(params, lr=0.05, betas=(0.9,), omegas=(0.7,), beta2=0.95)


POLICIES = {
    "mtdao (unified)": lambda: unified(4),
    "desloc (per-state periods)": lambda: desloc(2),
    "diloco (outer step)": lambda: explicit(4, outer=OuterOptimizerConfig()),
    "ddp (gradients every step)": gradient_averaging,
}


class Replica:
    """One replica in a thread: its own model, optimizer, engine and communicator."""

    def __init__(self, replica_id: int, address: str, policy, steps: int, **engine) -> None:
        self.replica_id, self.steps = replica_id, steps
        self.params = [torch.nn.Parameter(t) for t in initial(replica_id)]
        self.optimizer = optimizer_for(self.params)
        config = torchft.ReplicaConfig(
            replica_id, address, TIMEOUTS["connect_timeout"], TIMEOUTS["quorum_timeout"]
        )
        collective = TIMEOUTS["collective_timeout"]
        self.communicator = torchft.ReplicaGroups(config, collective_timeout=collective)
        self.sync = LocalUpdateSync(self.optimizer, policy, self.communicator, **engine)
        self.rounds: dict[int, dict] = {}  # step -> the whole state after that committed round
        self.at_quorum: dict[int, dict] = {}  # step -> the whole state once its quorum formed
        self.starts: list = []
        self.discarded: list = []
        self.error: BaseException | None = None
        self.final: dict = {}
        self.before_step: Callable[[Replica], None] = lambda replica: None

    def run(self) -> None:
        try:
            self.communicator.connect()
            while self.sync.step_count < self.steps:
                self.before_step(self)
                try:
                    self.step()
                except RoundNotCommitted as failure:  # as the harness does: go on locally
                    self.optimizer.zero_grad(set_to_none=True)
                    self.discarded.append((self.sync.step_count, failure))
            self.final = self.sync.state_dict()  # rounds in flight complete, in the quorum
        except BaseException as error:  # handed to the test thread
            self.error = error
        finally:
            self.communicator.shutdown()

    def step(self) -> None:
        start = self.sync.prepare()
        if start is not None:
            self.starts.append((self.sync.step_count, start))
            self.at_quorum[self.sync.step_count] = self.state()
        inputs, targets = data(self.replica_id, self.sync.step_count)
        loss(*self.params, inputs, targets).backward()
        rounds = len(self.sync.events)
        self.sync.step()
        self.optimizer.zero_grad(set_to_none=True)
        if len(self.sync.events) > rounds:
            self.rounds[self.sync.step_count] = self.state()

    def state(self) -> dict:
        return {
            "params": [p.detach().clone() for p in self.params],
            "optimizer": {
                key: value.clone() if torch.is_tensor(value) else value
                for p in self.params
                for key, value in sorted(self.optimizer.state[p].items())
            },
            "engine": self.sync.state_dict(),
        }


def assert_same(a, b, where: str = "state") -> None:
    """Bitwise equal, through nested dicts and lists."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


def threads_limit_s(replicas: list[Replica], delays: dict[int, float] | None = None) -> float:
    """How long replica threads take to their end (wait_limits): no process starts; their steps,
    all at once, after the longest delay; and what one may wait on a peer before it fails and
    says so, its connect, quorum and collective timeouts."""
    steps = max(replica.steps for replica in replicas)
    waits = max((delays or {}).values(), default=0.0) + sum(TIMEOUTS.values())
    return limit_s(starts=0, steps=steps, processes=len(replicas), sat_out_s=waits)


def run_threads(replicas: list[Replica], delays: dict[int, float] | None = None) -> None:
    """Run every replica to its end in daemon threads (a hung one cannot outlive the test);
    ``delays`` by position in ``replicas``."""
    limit = threads_limit_s(replicas, delays)
    delays = delays or {}

    def target(index: int, replica: Replica) -> None:
        time.sleep(delays.get(index, 0.0))
        replica.run()

    threads = [
        threading.Thread(target=target, args=(i, r), daemon=True) for i, r in enumerate(replicas)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + limit
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a replica thread did not finish"


@pytest.fixture
def lighthouse(request):
    server = torchft.start_lighthouse(
        "[::]:0", getattr(request, "param", 1), join_timeout=2.0, heartbeat_timeout=1.0
    )
    yield server.address()
    server.shutdown()


def assert_equal_states(a: dict, b: dict, optimizer_states: bool = True) -> None:
    torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)
    if optimizer_states:
        torch.testing.assert_close(a["optimizer"], b["optimizer"], rtol=0, atol=0)
    assert a["engine"]["step"] == b["engine"]["step"]
    torch.testing.assert_close(a["engine"]["anchors"], b["engine"]["anchors"], rtol=0, atol=0)
    torch.testing.assert_close(a["engine"]["outer"], b["engine"]["outer"], rtol=0, atol=0)


def simulated(policy, steps: int, workers: bool = False, **engine) -> list[torch.Tensor]:
    """The same run with 3 simulated workers, all starting from replica 0's initial values:
    worker 0's parameters (``workers``: every worker's, stacked)."""
    params = [torch.nn.Parameter(t.expand(3, *t.shape).clone()) for t in initial(0)]
    optimizer = optimizer_for(params)
    sync = LocalUpdateSync(optimizer, policy, SimulatedWorkers(3), **engine)
    for step in range(steps):
        pairs = [data(w, step) for w in range(3)]
        inputs = torch.stack([p[0] for p in pairs])
        targets = torch.stack([p[1] for p in pairs])
        loss(*params, inputs, targets).backward()
        sync.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach() if workers else p.detach()[0] for p in params]


@pytest.mark.parametrize("lighthouse", [3], indirect=True)
@pytest.mark.parametrize("name", POLICIES)
def test_three_replicas_are_three_simulated_workers(name, lighthouse):
    steps = 12  # a whole cycle of every policy: everything is averaged at the end
    replicas = [Replica(r, lighthouse, POLICIES[name](), steps) for r in range(3)]
    run_threads(replicas)
    for replica in replicas:
        assert replica.error is None, repr(replica.error)
    final = [r.rounds[steps] for r in replicas]
    for other in final[1:]:  # bitwise: one all-reduce, one division (DiLoCo keeps states local)
        assert_equal_states(final[0], other, optimizer_states="diloco" not in name)
    expected = simulated(POLICIES[name](), steps)
    torch.testing.assert_close(final[0]["params"], expected)
    assert [len(r.sync.events) for r in replicas] == [len(replicas[0].sync.events)] * 3


INT8 = SyncCodecs.parse(["int8"], error_feedback=True)
TOP_K = SyncCodecs.parse(["params=top8", "momenta=top8", "second-moment=int4"], True)
OPTION_POLICIES = {  # every round option at once, rounds overlapping in flight or not
    "mtdao (unified)": (lambda: unified(4), dict(delay=2, fragments=2, codecs=INT8)),
    "desloc (per-state periods)": (lambda: desloc(2), dict(delay=1, fragments=2, codecs=INT8)),
    "half-life (per-state periods)": (  # exp_avg_0 every 8 steps, exp_avg_sq every 12
        lambda: half_life_policy(4, {"exp_avg_0": 0.9, "exp_avg_sq": 0.95}),
        dict(delay=3, fragments=2, codecs=INT8),
    ),
    "diloco (outer step)": (
        lambda: explicit(4, outer=OuterOptimizerConfig()),
        dict(delay=3, fragments=2, codecs=SyncCodecs.parse(["params=int8"])),
    ),
    "mtdao (top-k payloads gathered whole)": (lambda: unified(4), dict(delay=3, codecs=TOP_K)),
}


OPTION_STEPS = 13  # ends with a round in flight


def gloo_rank_runs() -> dict[str, list[torch.Tensor]]:
    """Each option policy's run as one process of a gloo group (what torchrun runs)."""
    import torch.distributed as dist

    runs = {}
    for name, (policy, options) in OPTION_POLICIES.items():
        rank = dist.get_rank()
        params = [torch.nn.Parameter(t) for t in initial(rank)]
        optimizer = optimizer_for(params)
        engine = dict(track_alignment=True, **options)
        sync = LocalUpdateSync(optimizer, policy(), ProcessGroupWorkers(), **engine)
        for step in range(OPTION_STEPS):
            loss(*params, *data(rank, step)).backward()
            sync.step()
            optimizer.zero_grad(set_to_none=True)
        runs[name] = [p.detach().clone() for p in params]
    return runs


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("gloo-options")
    # a fork server's start, then its ranks each run every policy, all at once
    steps = OPTION_STEPS * len(OPTION_POLICIES)
    limit = limit_s(steps=steps, processes=3)
    return run_on_gloo(gloo_rank_runs, 3, root, preload=[__name__], timeout_s=limit)


@pytest.mark.parametrize("lighthouse", [3], indirect=True)
@pytest.mark.parametrize("name", OPTION_POLICIES)
def test_delayed_fragmented_int8_replicas_are_the_simulated_workers_bit_for_bit(
    name, lighthouse, gloo_runs
):
    """Fault-tolerant replicas, processes of a gloo group (as under torchrun) and simulated
    workers: the same parameters on every worker, exactly, with every round option on."""
    policy, options = OPTION_POLICIES[name]
    steps = OPTION_STEPS
    replicas = [
        Replica(r, lighthouse, policy(), steps, track_alignment=True, **options) for r in range(3)
    ]
    run_threads(replicas)
    for replica in replicas:
        assert replica.error is None, repr(replica.error)
        assert not replica.discarded
    expected = simulated(policy(), steps, workers=True, track_alignment=True, **options)
    for w, replica in enumerate(replicas):  # every replica is its simulated worker, exactly
        for param, worker, process in zip(replica.params, expected, gloo_runs[w][name]):
            assert torch.equal(param.detach(), worker[w])
            assert torch.equal(param.detach(), process)
        assert replica.sync.events == replicas[0].sync.events
        assert len(replica.sync.rounds.pending) >= 1  # settled early or not, applied at its step
    cosines = [[a["cosine"] for a in r.sync.alignment] for r in replicas]
    assert cosines[1:] == cosines[:1] * 2 and cosines[0]


def run_with_a_late_joiner(replicas: list[Replica]) -> Replica:
    """Run the replicas, the last one starting late: it connects only once the others all wait
    at step 10, and they wait there until it has started, so it joins a run in progress however
    slowly the machine runs them. Returns the late one."""
    started = threading.Event()
    others_waiting = threading.Semaphore(0)
    limit = threads_limit_s(replicas)  # each wait below waits for a part of the run

    def wait_for_the_late_one(replica: Replica) -> None:
        if replica.sync.step_count == 10:
            others_waiting.release()
            assert started.wait(limit)

    late = replicas[-1]
    run_late = late.run

    def run_once_the_others_wait() -> None:
        for _ in replicas[:-1]:
            if not others_waiting.acquire(timeout=limit):
                late.error = TimeoutError("the other replicas never reached step 10")
                return
        run_late()

    late.run = run_once_the_others_wait
    late.before_step = lambda replica: started.set()
    for replica in replicas[:-1]:
        replica.before_step = wait_for_the_late_one
    run_threads(replicas)
    return late


@pytest.mark.parametrize("lighthouse", [2], indirect=True)
@pytest.mark.parametrize("codecs", [INT8, TOP_K], ids=["int8", "top-k gathered whole"])
def test_a_late_replica_heals_every_state_and_the_rounds_in_flight(codecs, lighthouse):
    """Delayed (D = 2), fragmented, quantized rounds with error feedback: the joiner becomes its
    source's exact copy, a round already committed but still to be applied included, together
    with the source's error-feedback residuals; afterwards every replica keeps the same global
    state (anchors, rounds and their averages)."""
    options = dict(delay=2, fragments=2, codecs=codecs)
    steps = 30
    replicas = [Replica(r, lighthouse, unified(4), steps, **options) for r in range(3)]
    late = run_with_a_late_joiner(replicas)
    for replica in replicas:
        assert replica.error is None, repr(replica.error)
        assert not replica.discarded

    joined_at, start = late.starts[0]
    assert joined_at > 10 and start.heal is not None and start.heal.source in (0, 1)
    healed = late.at_quorum[joined_at]
    assert healed["engine"]["pending"], "no round in flight at the heal"
    assert healed["engine"]["pending"][0]["committed"]  # settled before the quorum
    assert healed["engine"]["pseudo_gradients"]["residuals"]
    assert_same(replicas[start.heal.source].at_quorum[joined_at], healed)
    final = [r.final for r in replicas]
    for other in final[1:]:
        for key in ("step", "anchors", "events", "traffic"):
            assert_same(final[0][key], other[key], key)
        averages = [[r["averages"] for r in state["pending"]] for state in (final[0], other)]
        assert_same(*averages)


LATE_POLICIES = {"unified": (lambda: unified(4), 4), "desloc": (lambda: desloc(2), 12)}


@pytest.mark.parametrize("lighthouse", [2], indirect=True)
@pytest.mark.parametrize("name", LATE_POLICIES)
def test_a_late_replica_heals_to_the_groups_exact_state(name, lighthouse):
    """Its first sync makes it the others' equal in everything that sync averages (with unified
    periods: everything); the first sync that averages every state, in everything."""
    policy, full_cycle = LATE_POLICIES[name]
    steps = 36  # a whole cycle: every state is averaged at the end
    replicas = [Replica(r, lighthouse, policy(), steps) for r in range(3)]
    late = run_with_a_late_joiner(replicas)
    for replica in replicas:
        assert replica.error is None, repr(replica.error)

    joined_at, start = late.starts[0]
    assert joined_at > 10 and start.heal is not None and start.heal.bytes > 0
    assert start.heal.source in (0, 1)
    first = min(late.rounds)
    for other in replicas[:2]:
        assert_equal_states(other.rounds[first], late.rounds[first], name == "unified")
    full = min(step for step in late.rounds if step % full_cycle == 0)
    for step in (full, steps):
        for other in replicas[:2]:
            assert_equal_states(other.rounds[step], late.rounds[step])
    assert late.sync.events == replicas[0].sync.events


@pytest.mark.parametrize("lighthouse", [3], indirect=True)
@pytest.mark.parametrize("action", ["skip", "raise"])
def test_the_nan_guard_spans_replicas(action, lighthouse):
    steps = 8
    replicas = [Replica(r, lighthouse, unified(4), steps, on_non_finite=action) for r in range(3)]

    def diverge(replica: Replica) -> None:
        if replica.sync.step_count == 5:
            with torch.no_grad():
                replica.params[0][0, 0] = float("nan")

    replicas[1].before_step = diverge
    run_threads(replicas)
    if action == "raise":
        for replica in replicas:
            assert isinstance(replica.error, NonFiniteError), repr(replica.error)
            assert "at step 8 in worker 1: param 0 of group 0" in str(replica.error)
        return
    for replica in replicas:
        assert replica.error is None, repr(replica.error)
    for other in replicas[1:]:  # the diverged replica took the others' average
        assert_equal_states(replicas[0].rounds[steps], other.rounds[steps])
    assert all(torch.isfinite(p).all() for p in replicas[1].params)
    assert replicas[0].sync.skipped_rounds[0]["workers"] == [1]


@pytest.mark.parametrize("lighthouse", [1], indirect=True)
def test_a_second_replica_with_a_taken_id_is_refused(lighthouse):
    first = Replica(0, lighthouse, unified(2), steps=30)
    second = Replica(0, lighthouse, unified(2), steps=30)
    ready = threading.Event()
    delays = {1: 1.0}
    limit = threads_limit_s([first, second], delays)  # the second's start: a part of the run
    second.before_step = lambda replica: ready.set()
    first.before_step = lambda replica: replica.sync.step_count == 6 and ready.wait(limit)
    run_threads([first, second], delays=delays)
    assert first.error is None, repr(first.error)
    assert isinstance(second.error, torchft.ReplicaRefused)
    assert "replica id 0 is already taken in the quorum (replicas 0, 0)" in str(second.error)
    assert first.sync.step_count == 30 and not second.rounds  # it averaged nothing


def test_an_unreachable_lighthouse_fails_within_the_connect_timeout():
    from mtdao.testing.ports import unused_port

    address = f"localhost:{unused_port()}"
    communicator = torchft.ReplicaGroups(torchft.ReplicaConfig(0, address, connect_timeout=1))
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"http://{address}.*--connect-timeout 1 s"):
        communicator.connect()
    assert time.monotonic() - started < 10
