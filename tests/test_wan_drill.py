"""``mtdao wan-drill``: scenarios, the relay's timing, the checks, and a short real drill that must
clean up after itself (normally and on SIGTERM).

The real drills need root, network namespaces and torchft; they skip with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wait_limits import limit_s

from mtdao.experiments.wan_drill.checks import check_loss, loss_band, mean_final_loss, run_checks
from mtdao.experiments.wan_drill.drill import LIGHTHOUSE_PORT, DrillSettings, WanDrill
from mtdao.experiments.wan_drill.report import baseline_summary
from mtdao.testing.network.netem import LinkUnavailable, _check_available, _sh
from mtdao.testing.network.relay import Port, Switch
from mtdao.testing.network.scenario import (
    DEFAULT_SCENARIO,
    EVENT_KINDS,
    load_scenario,
    scenario_from_dict,
)
from mtdao.testing.network.sites import NETNS_ETC, cleanup_stale, live_namespaces
from mtdao.testing.network.straggler import cpu_cgroup_root

ROOT = Path(__file__).resolve().parents[1]

# -- scenarios ----------------------------------------------------------------------------------


def test_a_yaml_scenario_sets_per_site_links_on_top_of_the_default(tmp_path):
    path = tmp_path / "far.yaml"
    path.write_text(
        "links:\n  default: {rate_mbit: 50}\n  r2: {delay_ms: 60}\n"
        "events:\n  - {at_s: 9, kind: partition, site: r2, for_s: 3}\n"
        "  - {at_s: 1, kind: kill, site: r0}\n"
        "replica_flags: [--sync-delay, '2']\n"
    )
    scenario = load_scenario(str(path))
    assert scenario.name == "far"
    assert scenario.link("r2").delay_ms == 60 and scenario.link("r2").rate_mbit == 50
    assert scenario.link("r0").rate_mbit == 50 and scenario.link("r0").delay_ms == 20
    assert [e.kind for e in scenario.events] == ["partition", "kill"]
    assert scenario.events[1].when == "1 s"
    assert scenario.replica_flags == ("--sync-delay", "2")


@pytest.mark.parametrize(
    "data, message",
    [
        ({"events": [{"at_s": 1, "kind": "explode", "site": "r0"}]}, "event kind must be one of"),
        ({"events": [{"at_s": 1, "kind": "kill", "site": "r0", "when": 3}]}, "unknown keys"),
        ({"events": [{"at_s": 1, "kind": "kill"}]}, "needs a replica site"),
        ({"events": [{"kind": "kill", "site": "r0"}]}, "exactly one of at_s and at_step"),
        ({"events": [{"at_s": 1, "kind": "lighthouse_restart", "site": "r1"}]}, "not 'r1'"),
        ({"links": {"default": {"loss": 1.5}}}, "loss must be in [0, 1)"),
        ({"event": []}, "unknown keys ['event']"),
    ],
)
def test_a_bad_scenario_is_refused_in_one_line(data, message):
    with pytest.raises(ValueError, match=None) as error:
        scenario_from_dict(data, "bad")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_scenario_naming_a_site_the_drill_lacks_is_refused():
    with pytest.raises(ValueError, match="site 'r2' is not one of a 2-replica drill's"):
        DEFAULT_SCENARIO.check_sites(2)
    DEFAULT_SCENARIO.check_sites(3)


def test_the_default_scenario_exercises_every_event_once():
    kinds = [event.kind for event in DEFAULT_SCENARIO.events]
    assert sorted(kinds) == sorted(EVENT_KINDS)
    assert load_scenario("full") == DEFAULT_SCENARIO  # the name of the old superset


# -- the relay's timing, without sockets ---------------------------------------------------------


def test_the_relay_adds_both_links_delays_and_drops_a_partitioned_sites_frames():
    switch = Switch([Port("a", delay_ms=20), Port("b", delay_ms=60), Port("c")])
    switch.schedule(0, 1, b"x", now=100.0)
    assert switch.queue[0][0] == pytest.approx(100.08)
    switch.ports[2].partitioned = True
    switch.schedule(0, 2, b"x", now=100.0)
    switch.schedule(2, 1, b"x", now=100.0)
    assert len(switch.queue) == 1
    assert switch.ports[0].counters["partition_dropped"] == 1


def test_jitter_never_reorders_a_path_and_loss_drops_about_its_share():
    switch = Switch([Port("a", jitter_ms=30, loss=0.1), Port("b", jitter_ms=30)], seed=3)
    for i in range(2000):
        switch.schedule(0, 1, b"x", now=i * 0.001)
    releases = [entry[0] for entry in sorted(switch.queue, key=lambda e: e[1])]
    assert releases == sorted(releases)
    assert 100 < switch.ports[0].counters["dropped"] < 300  # 10 % of 2000, give or take


# -- how the drill starts its processes, without namespaces ------------------------------------


class FakeSites:
    """Sites that start nothing: they keep the argv of what they were asked to run."""

    prefix = "wanfake"
    addresses = {"lighthouse": "10.9.0.1", "r0": "10.9.0.2", "r1": "10.9.0.3"}
    hostnames = {site: f"wanfake-{site}" for site in addresses}

    def __init__(self) -> None:
        self.spawned: list[tuple[str, list[str]]] = []

    def run(self, site, argv, env=None, **popen_kwargs) -> subprocess.Popen:
        self.spawned.append((site, argv))
        process = subprocess.Popen(["true"])
        process.wait()
        return process


def flag_value(argv: list[str], flag: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]  # the last one counts


def test_every_process_serves_on_its_sites_address_and_replicas_share_a_private_secret(tmp_path):
    scenario = scenario_from_dict({"replica_flags": ["--sync-delay", "2"]}, "flags")
    sites = FakeSites()
    drill = WanDrill(sites, scenario, DrillSettings(replicas=2), tmp_path)
    secrets_seen = set()
    for site in ("r0", "r1"):
        drill.start_replica(site)
        ran_in, argv = sites.spawned[-1]
        assert ran_in == site and flag_value(argv, "--out") == str(tmp_path / "replicas" / site)
        assert flag_value(argv, "--replica-id") == site[1:]
        assert flag_value(argv, "--bind-host") == FakeSites.addresses[site]
        assert argv[-2:] == ["--sync-delay", "2"]  # extra flags pass through, last
        token = Path(flag_value(argv, "--auth-token-file"))
        assert token.parent == tmp_path and token.stat().st_mode & 0o777 == 0o600
        secrets_seen.add(token.read_text())
    assert len(secrets_seen) == 1 and len(secrets_seen.pop().strip()) == 64
    other = WanDrill(FakeSites(), scenario, DrillSettings(replicas=2), tmp_path / "other")
    assert other.auth_token.read_text() != drill.auth_token.read_text()  # one secret per drill
    other.close()
    drill.start_lighthouse()
    site, argv = sites.spawned[-1]
    assert site == "lighthouse" and "--bind" not in argv
    assert flag_value(argv, "--bind-host") == "10.9.0.1"
    assert flag_value(argv, "--port") == str(LIGHTHOUSE_PORT)
    drill.start_replica("r1")  # its second incarnation reaches the lighthouse by host name
    assert (
        flag_value(sites.spawned[-1][1], "--lighthouse") == f"wanfake-lighthouse:{LIGHTHOUSE_PORT}"
    )
    assert drill.incarnations["r1"][-1]["key"] == "r1-1"
    drill.close()
    assert not drill.auth_token.exists()  # the secret outlives no drill


# -- the checks, on made-up records --------------------------------------------------------------


def made_up_record(digests=("d", "d"), metric_steps=(16, 32, 48), heals=(), checkpoints=(48,)):
    def replica(digest):
        metrics = [{"step": s, "train_loss": 3.0} for s in metric_steps]
        events = [{"event": "quorum", "time": 0, "step": h - 1, "heal": {"step": h}} for h in heals]
        return {
            "metrics": metrics,
            "metrics_damaged_lines": [],
            "events": events,
            "final_val_loss": 2.5,
            "checkpoints": list(checkpoints),
            "incarnations": [{"key": "r", "returncode": 0, "rounds": {48: digest}, "log_tail": ""}],
        }

    return {
        "settings": {"steps": 48, "sync_period": 16},
        "failures": [],
        "events": [],
        "replicas": {f"r{i}": replica(d) for i, d in enumerate(digests)},
    }


def test_the_checks_pass_a_clean_record_and_name_what_a_bad_one_lost():
    assert all(check.passed for check in run_checks(made_up_record(), None))
    by_name = {c.name: c for c in run_checks(made_up_record(digests=("a", "b")), None)}
    assert not by_name["same model everywhere"].passed
    gap = {c.name: c for c in run_checks(made_up_record(metric_steps=(16, 48)), None)}
    assert "steps 16 .. 48 missing" in gap["metrics continuous"].detail
    healed = run_checks(made_up_record(metric_steps=(16, 48), heals=(40,)), None)
    assert all(check.passed for check in healed)
    wiped = {c.name: c for c in run_checks(made_up_record(checkpoints=()), None)}
    assert not wiped["no checkpoint wiped"].passed


def test_with_fragmented_rounds_replicas_must_share_their_global_state():
    record = made_up_record(digests=("a", "b"))
    record["scenario"] = {"replica_flags": ["--sync-fragments", "4", "--sync-delay", "2"]}
    for name, replica in zip(("g", "g"), record["replicas"].values()):
        replica["incarnations"][-1]["globals"] = {48: name}
    by_name = {c.name: c for c in run_checks(record, None)}
    assert by_name["same model everywhere"].passed, by_name["same model everywhere"].detail
    record["replicas"]["r1"]["incarnations"][-1]["globals"] = {48: "h"}
    by_name = {c.name: c for c in run_checks(record, None)}
    assert "global states at step 48 differ" in by_name["same model everywhere"].detail
    record["scenario"] = {"replica_flags": []}  # blocking rounds: the whole states must agree
    record["replicas"]["r1"]["incarnations"][-1]["globals"] = {48: "g"}
    assert not {c.name: c for c in run_checks(record, None)}["same model everywhere"].passed


def test_the_loss_band_is_the_no_event_range_widened_by_its_width():
    assert loss_band([2.0, 2.1], slack=1.0) == pytest.approx((1.9, 2.2))
    assert check_loss(made_up_record(), [2.45, 2.55], 1.0).passed
    assert not check_loss(made_up_record(), [2.0, 2.1], 1.0).passed
    assert "at least 2 drills" in check_loss(made_up_record(), [2.5], 1.0).detail


def test_a_drill_and_its_no_event_drills_are_judged_by_the_same_mean():
    record = made_up_record(digests=("d", "d", "d"))
    for site, loss in zip(("r0", "r1", "r2"), (2.0, 2.3, None)):  # r2 did not finish
        record["replicas"][site]["final_val_loss"] = loss
    assert mean_final_loss(record) == pytest.approx(2.15)
    assert baseline_summary(record)["final_val_loss"] == pytest.approx(2.15)  # not r0's 2.0


# -- real drills ---------------------------------------------------------------------------------

PREFIX = f"wantest{os.getpid() % 10000}"
REPLICAS, SYNC_PERIOD = 2, 16
HEARTBEAT_S, COLLECTIVE_S = 1, 6  # the replicas' timeouts: short, so that a drill is quick
PARTITION_S, KILL_S = 5, 1  # how long the short drill's events last
JOIN_S = DrillSettings().join_timeout_s  # the lighthouse waits this long for a returning replica
SITES_S = 30  # building or removing a drill's sites: dozens of `ip` commands, slow under load
# a round across the default links (20 ms, 100 Mbit/s): the quorum, all-reduce and commit calls
# cross them; 0.3 - 0.8 s measured
ROUND_S = 0.8
# the longest a live replica's step stays put: a restarted replica's start, dropped by the
# heartbeat and admitted again by the lighthouse (a partition's stall, 5 + 6 s, is shorter)
HANG_S = limit_s(starts=1, processes=REPLICAS + 2, sat_out_s=HEARTBEAT_S + JOIN_S)


@pytest.fixture
def can_emulate():
    pytest.importorskip("torchft")
    try:
        _check_available()
    except LinkUnavailable as error:
        pytest.skip(str(error))


def leftovers(prefix: str) -> list[str]:
    found = live_namespaces(prefix)
    if NETNS_ETC.is_dir():
        found += [p.name for p in NETNS_ETC.iterdir() if p.name.startswith(f"{prefix}-")]
    root = cpu_cgroup_root()
    if root is not None:
        found += [p.name for p in root[0].iterdir() if p.name.startswith(f"{prefix}-")]
    return found


def test_namespaces_of_a_dead_drill_are_removed_and_a_live_ones_kept(can_emulate):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"{PREFIX}-{dead.pid}-0-hub", f"{PREFIX}-{os.getpid()}-0-hub"
    for name in (stale, live):
        _sh("ip", "netns", "add", name)
        (NETNS_ETC / name).mkdir(parents=True, exist_ok=True)
    try:
        assert cleanup_stale(PREFIX) == [stale]
        assert leftovers(PREFIX) == [live, live]
    finally:
        cleanup_stale(PREFIX)
        _sh("ip", "netns", "delete", live)
        (NETNS_ETC / live).rmdir()


def deadline_s(steps: int) -> float:
    """A drill's --deadline, from its first replica started: the replicas' start and a killed
    one's restart, every step beside the lighthouse and the relay, and what they sit out: each
    round across the links, the events, a timed-out round, the heartbeat and join timeouts."""
    rounds = steps // SYNC_PERIOD
    waits = rounds * ROUND_S + PARTITION_S + COLLECTIVE_S + KILL_S + HEARTBEAT_S + JOIN_S
    return limit_s(starts=2, steps=steps, processes=REPLICAS + 2, sat_out_s=waits)


def drill_s(steps: int) -> float:
    """``mtdao wan-drill`` in all: its start and its relay's, the sites built and removed, the
    drill's deadline, then its report and plots (a start's work)."""
    return limit_s(starts=3, sat_out_s=2 * SITES_S + deadline_s(steps))


def drill_command(out: Path, scenario: Path, steps: int = 256, extra=()) -> list[str]:
    argv = [sys.executable, "-m", "mtdao", "wan-drill", "--scenario", str(scenario)]
    argv += ["--replicas", str(REPLICAS), "--steps", str(steps)]
    argv += ["--sync-period", str(SYNC_PERIOD), "--out", str(out), "--prefix", PREFIX]
    argv += ["--heartbeat-timeout", str(HEARTBEAT_S), "--collective-timeout", str(COLLECTIVE_S)]
    argv += ["--hang-limit", f"{HANG_S:.0f}", "--deadline", f"{deadline_s(steps):.0f}"]
    return [*argv, *extra]


@pytest.mark.slow
@pytest.mark.soak  # a whole drill across emulated sites, 60-100 s
def test_a_short_drill_survives_its_events_checks_them_and_cleans_up(can_emulate, tmp_path):
    scenario = tmp_path / "short.json"
    # at steps, not seconds: the machine's speed varies; the kill comes last, with steps enough
    # left for the restarted replica's start-up while the other trains on alone (or the run
    # ends with two models, rightly failed)
    events = [{"at_step": 64, "kind": "partition", "site": "r1", "for_s": PARTITION_S},
              {"at_step": 192, "kind": "kill", "site": "r1", "for_s": KILL_S}]  # fmt: skip
    scenario.write_text(json.dumps({"events": events}))
    # no-event drills far from any real loss: the loss check must fail, and only it
    fakes = []
    for seed, loss in ((7, 0.5), (8, 0.51)):
        fakes.append(tmp_path / f"fake-{seed}.json")
        replica = {"final_val_loss": loss, "metrics": []}
        fake = {"settings": {"seed": seed}, "t0": 0, "samples": [], "replicas": {"r0": replica}}
        fakes[-1].write_text(json.dumps(fake))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    steps = 800
    command = drill_command(tmp_path / "out", scenario, steps, ["--baseline", *map(str, fakes)])
    done = subprocess.run(command, capture_output=True, text=True, timeout=drill_s(steps), env=env)
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert [line for line in lines if line.startswith("FAIL")] == [
        next(line for line in lines if "final loss within the no-event spread" in line)
    ], done.stdout
    for name in ("every replica finished", "same model everywhere", "metrics continuous"):
        assert any(line.startswith(f"pass  {name}") for line in lines), done.stdout
    record = json.loads((tmp_path / "out" / "drill" / "drill.json").read_text())
    assert len(record["replicas"]["r1"]["incarnations"]) == 2  # killed and restarted
    assert (tmp_path / "out" / "report.md").exists() and (
        tmp_path / "out" / "timeline.png"
    ).exists()
    assert leftovers(PREFIX) == []


# to replica r1's start: the drill's start and its relay's, the sites built; after SIGTERM, its
# processes SIGKILLed and the sites removed
STARTED_S = limit_s(starts=2, sat_out_s=SITES_S)
ENDED_S = limit_s(starts=0, sat_out_s=SITES_S)


@pytest.mark.slow  # builds the sites and starts the replicas of a drill
def test_sigterm_mid_drill_leaves_no_namespace_and_no_process(can_emulate, tmp_path):
    scenario = tmp_path / "none.json"
    scenario.write_text("{}")
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    drill = subprocess.Popen(drill_command(out, scenario, extra=["--baseline-seeds"]), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.time() + STARTED_S
        while not list((out / "drill").glob("r1.log")) and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # replicas starting inside their sites
        assert leftovers(PREFIX), "the drill built no namespaces"
        drill.send_signal(signal.SIGTERM)
        assert drill.wait(timeout=ENDED_S) != 0
    finally:
        if drill.poll() is None:
            drill.kill()
            drill.wait()
    assert leftovers(PREFIX) == []
    mine = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).count(str(out))]
    assert mine == []


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_the_report_names_a_drill_without_events_that_did_not_finish():
    from mtdao.experiments.wan_drill.report import render

    results = json.loads((ROOT / "reports" / "wan-drill" / "results.json").read_text())
    baselines = [dict(b) for b in results["baselines"]]
    baselines[-1]["final_val_loss"] = None  # a drill that passed its deadline
    report = render({**results, "baselines": baselines, "ddp": None})
    assert "did not finish" in report
