"""One drill across WAN sites: a lighthouse, fault-tolerant replicas, a scenario's timed events.

The lighthouse runs in site ``lighthouse``, replica i (``mtdao train --fault-tolerant --resume``
under :mod:`mtdao.testing.fault_drill`, which records a digest of its whole state after every
committed round) in site ``r<i>``. The clock of the scenario starts once every replica has taken
its first step. Every half second the drill samples each replica's step and each site's bytes;
a replica alive whose step has not moved for ``hang_limit_s`` is a hang, and ends the drill.

Everything ends by itself: replicas have their own timeouts, the drill a deadline, and on the
way out (normally, on an exception, Ctrl-C or SIGTERM) it kills what it started, gives back CPU
quotas and deletes the namespaces. :func:`run_drill` returns the record the checks and the
report read (:mod:`.checks`, :mod:`.report`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mtdao.experiments.wan_drill.record import checkpoint_steps, collect
from mtdao.testing.fault_drill import Drill
from mtdao.testing.network.scenario import LIGHTHOUSE, Event, Scenario
from mtdao.testing.network.sites import SITE_IFACE, WanSites, exit_on_sigterm
from mtdao.testing.network.straggler import CpuQuota

LIGHTHOUSE_PORT = 29510  # inside the lighthouse's own namespace: nothing else listens there
SAMPLE_S = 0.5
AUTH_TOKEN_NAME = "auth.token"


@dataclass(frozen=True)
class DrillSettings:
    """The training run every drill repeats, and the limits it is held to."""

    replicas: int = 3
    model: str = "micro"
    steps: int = 1280
    sync_period: int = 16
    batch_size: int = 4
    seq_len: int = 32
    eval_tokens: int = 2048
    seed: int = 0
    data: str | None = None
    checkpoint_every: int = 64
    heartbeat_timeout_s: float = 2.0
    join_timeout_s: float = 10.0
    connect_timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    collective_timeout_s: float = 10.0
    hang_limit_s: float = 90.0
    """A live replica whose step does not move for this long is hung (above every timeout)."""
    start_timeout_s: float = 240.0
    deadline_s: float = 900.0
    """The whole drill's limit, from the first replica started."""
    emulation: str = "auto"

    def train_flags(self) -> list[str]:
        flags = ["--workers", str(self.replicas), "--model", self.model, "--steps", str(self.steps)]
        flags += ["--sync-period", str(self.sync_period), "--batch-size", str(self.batch_size)]
        flags += ["--seq-len", str(self.seq_len), "--eval-tokens", str(self.eval_tokens)]
        flags += ["--seed", str(self.seed), "--log-every", str(self.sync_period), "--no-progress"]
        flags += [
            "--eval-every",
            str(max(self.steps // 8 // self.sync_period, 1) * self.sync_period),
        ]
        return flags + (["--data", self.data] if self.data else [])


class WanDrill:
    """The processes of one drill in ``sites``, started and killed by the fault drill's
    controller (:class:`mtdao.testing.fault_drill.Drill`, launching each inside its site);
    ``out`` holds their logs and run directories."""

    def __init__(self, sites: WanSites, scenario: Scenario, settings: DrillSettings, out: Path):
        self.sites, self.scenario, self.settings, self.out = sites, scenario, settings, out
        self.control = out / "control"
        out.mkdir(parents=True, exist_ok=True)
        self.auth_token = write_auth_token(out / AUTH_TOKEN_NAME)
        self.drill = Drill(
            self.control,
            settings.train_flags(),
            settings.heartbeat_timeout_s,
            settings.join_timeout_s,
            logs=out,
            port=LIGHTHOUSE_PORT,  # inside the lighthouse's own namespace
            env={"GLOO_SOCKET_IFNAME": SITE_IFACE},
            launch=self._launch_in_site,
        )
        self.processes = self.drill.processes
        self.incarnations: dict[str, list[dict[str, Any]]] = {}  # site -> its processes
        self.samples: list[dict[str, Any]] = []
        self.applied: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.quota = CpuQuota(sites.prefix)
        self.t0: float | None = None
        self.started = time.time()

    # -- processes --------------------------------------------------------------------------

    def _launch_in_site(self, key: str, argv: list[str], env: dict, log) -> subprocess.Popen:
        site = key.split("-")[0]  # "r1-2": the third incarnation of site r1
        return self.sites.run(site, argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def start_lighthouse(self) -> None:
        count = len(self.incarnations.get(LIGHTHOUSE, []))
        key = f"{LIGHTHOUSE}-{count}"
        self.drill.start_lighthouse(
            bind_host=self.sites.addresses[LIGHTHOUSE],
            name=key,
            reached_at=self.sites.hostnames[LIGHTHOUSE],
            flags=self.site_flags(LIGHTHOUSE, self.scenario.lighthouse_flags),
        )
        self.incarnations.setdefault(LIGHTHOUSE, []).append(
            {"key": key, "started": time.time(), "ended": None, "returncode": None}
        )

    def replica_flags(self, site: str) -> list[str]:
        """The flags of ``site``'s replica beside the drill's shared training flags."""
        s = self.settings
        flags = ["--resume", "--checkpoint-every", str(s.checkpoint_every)]
        flags += ["--connect-timeout", str(s.connect_timeout_s)]
        flags += ["--quorum-timeout", str(s.quorum_timeout_s)]
        flags += ["--collective-timeout", str(s.collective_timeout_s)]
        # off loopback, as across real sites: the site's own address and the drill's secret
        flags += ["--bind-host", self.sites.addresses[site]]
        flags += ["--auth-token-file", str(self.auth_token)]
        return flags + self.site_flags(site, self.scenario.replica_flags)

    def site_flags(self, site: str, flags) -> list[str]:
        """Extra flags with ``{site}``, ``{address}`` and ``{hostname}`` filled in for ``site``
        (e.g. ``--out runs/{site}``); they come last, so they override the drill's own."""
        values = {"site": site, "address": self.sites.addresses[site],
                  "hostname": self.sites.hostnames[site]}  # fmt: skip
        return [flag.format(**values) for flag in flags]

    def start_replica(self, site: str, hold: bool = False) -> None:
        """Start ``site``'s next incarnation (held before it connects when ``hold``)."""
        count = len(self.incarnations.get(site, []))
        key = site if count == 0 else f"{site}-{count}"
        out = self.out / "replicas" / site
        self.drill.start(key, int(site[1:]), self.replica_flags(site), hold=hold, out=out)
        self.incarnations.setdefault(site, []).append(
            {"key": key, "started": time.time(), "ended": None, "returncode": None}
        )

    def current(self, site: str) -> dict[str, Any]:
        return self.incarnations[site][-1]

    def kill(self, site: str) -> None:
        incarnation = self.current(site)
        self.drill.kill(incarnation["key"])
        returncode = self.drill.returncode(incarnation["key"])
        incarnation.update(ended=time.time(), returncode=returncode, killed=True)

    def step_of(self, key: str) -> int:
        """The step replica ``key`` is at, -1 until it trains."""
        state, step = self.drill.status(key)
        return step if state == "running" else -1

    def replica_sites(self) -> list[str]:
        return [f"r{i}" for i in range(self.settings.replicas)]

    # -- the scenario -----------------------------------------------------------------------

    def begin(self, event: Event) -> dict[str, Any]:
        """Start ``event``; returns its record (with ``until``, when it is to be undone)."""
        record = {**asdict(event), "label": event.label, "began": time.time()}
        site = event.site
        if event.kind == "kill":
            record["step_at_event"] = self.step_of(self.current(site)["key"])
            record["checkpoints_before"] = checkpoint_steps(self.out / "replicas" / site)
            self.kill(site)
        elif event.kind == "lighthouse_restart":
            self.kill(LIGHTHOUSE)
        elif event.kind == "partition":
            self.sites.partition(site)
        elif event.kind == "slow_link":
            record["rate_mbit"] = self.sites.links[site].rate_mbit
            self.sites.set_rate(site, record["rate_mbit"] * event.rate_factor)
        elif event.kind == "straggler":
            pid = self.processes[self.current(site)["key"]].pid
            record["quota_method"] = self.quota.limit(site, pid, event.cpu_share)
        record["until"] = record["began"] + event.for_s
        return record

    def end(self, record: dict[str, Any]) -> None:
        kind, site = record["kind"], record["site"]
        if kind == "kill":
            self.start_replica(site)
        elif kind == "lighthouse_restart":
            self.start_lighthouse()
        elif kind == "partition":
            self.sites.heal(site)
        elif kind == "slow_link":
            self.sites.set_rate(site, record["rate_mbit"])
        elif kind == "straggler":
            self.quota.release(site)
        record["ended"] = time.time()

    # -- the main loop ----------------------------------------------------------------------

    def run(self) -> None:
        s = self.settings
        self.start_lighthouse()
        # all start held and are released together: the first quorum then holds every replica
        for site in self.replica_sites():
            self.start_replica(site, hold=True)
        deadline = self.started + s.deadline_s
        self._wait_for_first_steps(time.time() + s.start_timeout_s)
        pending = list(self.scenario.events)
        active: list[dict[str, Any]] = []
        last_move: dict[str, tuple[int, float]] = {}
        while True:
            now = time.time()
            for event in [e for e in pending if self._due(e, now)]:
                pending.remove(event)
                record = self.begin(event)
                self.applied.append(record)
                active.append(record)
            for record in [r for r in active if now >= r["until"]]:
                self.end(record)
                active.remove(record)
            self._sample(now)
            self._note_exits()
            if self._hung(now, last_move):
                break
            running = [k for k, p in self.processes.items() if not k.startswith(LIGHTHOUSE)
                       and p.poll() is None]  # fmt: skip
            if not running and not active:
                break
            if now > deadline:
                self.failures.append(f"the drill passed its deadline of {s.deadline_s:g} s")
                break
            time.sleep(0.2)
        for event in pending:
            self.failures.append(f"event {event.label} at {event.when} never ran: the run "
                                 "ended first (a scenario longer than the run)")  # fmt: skip
        for record in active:  # give back what was taken; nothing is restarted any more
            if record["kind"] not in ("kill", "lighthouse_restart"):
                self.end(record)

    def _due(self, event: Event, now: float) -> bool:
        if event.at_s is not None:
            return now >= self.t0 + event.at_s
        frontier = max(self.step_of(self.current(s)["key"]) for s in self.replica_sites())
        return frontier >= event.at_step

    def _wait_for_first_steps(self, deadline: float) -> None:
        released = False
        while True:
            self._note_exits()
            keys = [self.current(s)["key"] for s in self.replica_sites()]
            if not released and all(self.drill.status(k)[0] != "starting" for k in keys):
                for key in keys:
                    self.drill.release(key)
                released = True
            if released and all(
                self.step_of(self.current(s)["key"]) >= 1 for s in self.replica_sites()
            ):
                self.t0 = time.time()
                return
            dead = [k for k, p in self.processes.items() if p.poll() is not None]
            if dead or time.time() > deadline:
                why = f"{dead} exited" if dead else "timed out"
                raise RuntimeError(f"replicas did not start ({why}):\n{self.tails()}")
            time.sleep(0.2)

    def _sample(self, now: float) -> None:
        if self.samples and now - self.samples[-1]["time"] < SAMPLE_S:
            return
        steps = {site: self.step_of(self.current(site)["key"]) for site in self.replica_sites()}
        sample = {"time": now, "steps": steps, "bytes": {}}
        for site in self.sites.names:
            with contextlib.suppress(Exception):
                sample["bytes"][site] = self.sites.interface_bytes(site)
        self.samples.append(sample)

    def _note_exits(self) -> None:
        for incarnations in self.incarnations.values():
            incarnation = incarnations[-1]
            process = self.processes[incarnation["key"]]
            if incarnation["ended"] is None and process.poll() is not None:
                incarnation.update(ended=time.time(), returncode=process.returncode)

    def _hung(self, now: float, last_move: dict[str, tuple[int, float]]) -> bool:
        for site in self.replica_sites():
            key = self.current(site)["key"]
            if self.processes[key].poll() is not None:
                continue
            step = self.step_of(key)
            if key not in last_move or last_move[key][0] != step:
                last_move[key] = (step, now)
            elif now - last_move[key][1] > self.settings.hang_limit_s:
                self.failures.append(
                    f"hang: {key} stayed at step {step} for more than "
                    f"{self.settings.hang_limit_s:g} s (--hang-limit)"
                )
                return True
        return False

    def tails(self, lines: int = 6) -> str:
        return self.drill.tails(lines)

    def close(self) -> None:
        self.quota.close()
        self.drill.close()
        self._note_exits()
        self.auth_token.unlink(missing_ok=True)  # a secret outlives no drill


def write_auth_token(path: Path) -> Path:
    """A fresh random secret for one drill, readable by its owner only (mode 0600)."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_hex(32) + "\n")
    return path


def run_drill(scenario: Scenario, settings: DrillSettings, out: Path, prefix: str) -> dict:
    """Run one drill; its record (see :func:`mtdao.experiments.wan_drill.record.collect`)."""
    scenario.check_sites(settings.replicas)
    out.mkdir(parents=True, exist_ok=True)
    names = [LIGHTHOUSE, *(f"r{i}" for i in range(settings.replicas))]
    sites = WanSites(
        {n: scenario.link(n) for n in names}, prefix, settings.emulation, settings.seed
    )
    with exit_on_sigterm():
        return _run_in(sites, scenario, settings, out)


def _run_in(sites: WanSites, scenario: Scenario, settings: DrillSettings, out: Path) -> dict:
    try:
        sites.build()
        drill = WanDrill(sites, scenario, settings, out)
        try:
            drill.run()
        except RuntimeError as error:
            drill.failures.append(str(error))
        finally:
            drill.close()
        record = collect(drill)
    finally:
        sites.close()
    (out / "drill.json").write_text(json.dumps(record, indent=1))
    return record
