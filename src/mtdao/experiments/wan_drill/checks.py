"""What a WAN drill must show, checked on its record (:mod:`.record`).

Each check returns a :class:`Check`: its name, whether it passed and one line saying why. The
drill exits non-zero when one fails. Known limits of the current code (a replica that does not
reconnect to a restarted lighthouse) fail the checks like any other failure, with the replica's
own last words in the detail.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


def check_completed(record: dict[str, Any]) -> Check:
    """No hang, no deadline passed, every event ran."""
    failures = record["failures"]
    if failures:
        return Check(
            "no hang, every event ran", False, "; ".join(f.splitlines()[0] for f in failures)
        )
    return Check("no hang, every event ran", True, f"{len(record['events'])} events ran")


def check_exits(record: dict[str, Any]) -> Check:
    """Every replica's last incarnation ended with exit code 0 (killed ones aside)."""
    bad = []
    for replica in record["replicas"].values():
        last = replica["incarnations"][-1]
        if last["returncode"] != 0:
            tail = [line for line in last["log_tail"].splitlines() if line.strip()]
            said = tail[-1] if tail else "(no output)"
            restarts = [e for e in record["events"] if e["kind"] == "lighthouse_restart"
                        and last["ended"] is not None and e["began"] < last["ended"]]  # fmt: skip
            at = restarts[0]["began"] - record["t0"] if restarts else 0.0
            after = (f" (after the lighthouse restart at {at:.0f} s)"
                     if restarts else "")  # fmt: skip
            bad.append(f"{last['key']} exited with {last['returncode']}{after}: {said}")
    if bad:
        return Check("every replica finished", False, "; ".join(bad))
    return Check("every replica finished", True, f"{len(record['replicas'])} replicas exited 0")


def check_same_model(record: dict[str, Any]) -> Check:
    """Every replica alive at the end holds the same state after the last round: its whole
    state, or, where rounds are delayed or fragmented (each replica then keeps its own local
    progress on what the last rounds did not cover), everything the replicas share."""
    steps = record["settings"]["steps"]
    whole, shared = {}, {}
    for site, replica in record["replicas"].items():
        last = replica["incarnations"][-1]
        if last["returncode"] == 0:
            whole[site] = _at(last["rounds"], steps)
            shared[site] = _at(last.get("globals", {}), steps)
    if not whole:
        return Check("same model everywhere", False, "no replica finished")
    missing = [site for site, digest in whole.items() if digest is None]
    if missing:
        return Check("same model everywhere", False, f"{missing} have no digest at step {steps}")
    if len(set(whole.values())) == 1:
        return Check(
            "same model everywhere", True, f"{len(whole)} replicas: {next(iter(whole.values()))}"
        )
    if _rounds_keep_local_progress(record) and None not in shared.values():
        if len(set(shared.values())) == 1:
            return Check(
                "same model everywhere", True,
                f"{len(shared)} replicas share one global state ({next(iter(shared.values()))}); "
                "their whole states differ only by the local progress delayed or fragmented "
                "rounds leave (as in the drills without events)",
            )  # fmt: skip
        return Check(
            "same model everywhere", False, f"global states at step {steps} differ: {shared}"
        )
    return Check("same model everywhere", False, f"digests at step {steps} differ: {whole}")


def _at(digests: dict, step: int) -> str | None:
    return digests.get(step) or digests.get(str(step))


def _rounds_keep_local_progress(record: dict[str, Any]) -> bool:
    """Whether the replicas' rounds are delayed or fragmented (from their flags)."""
    from mtdao.train.command import config_from_argv

    config = config_from_argv(list(record.get("scenario", {}).get("replica_flags", [])))
    return config.sync.sync_delay > 0 or config.sync.sync_fragments > 1


def metrics_gaps(replica: dict[str, Any], log_every: int) -> list[str]:
    """Problems of one replica's metrics: damaged lines, steps going back, and gaps that neither a
    heal (the replica jumps to the group's step) nor a discarded round (no line is logged for a
    round that was not applied) explains."""
    problems = [f"damaged line {n}" for n in replica["metrics_damaged_lines"]]
    steps = [m["step"] for m in replica["metrics"] if "train_loss" in m]
    explained = [e["heal"]["step"] for e in replica["events"] if e.get("heal")]
    explained += [e["step"] for e in replica["events"] if e["event"] == "discarded"]
    for before, after in zip(steps, steps[1:]):
        if after <= before:
            problems.append(f"step {after} after {before}")
        elif after - before > log_every and not any(before < s < after for s in explained):
            problems.append(f"steps {before} .. {after} missing, no heal or discarded round")
    return problems


def check_metrics(record: dict[str, Any]) -> Check:
    log_every = record["settings"]["sync_period"]
    problems = {}
    for site, replica in record["replicas"].items():
        found = metrics_gaps(replica, log_every)
        if not replica["metrics"]:
            found.append("no metrics")
        if found:
            problems[site] = found[:3]
    if problems:
        return Check("metrics continuous", False, str(problems))
    return Check("metrics continuous", True, "every gap is a heal or a discarded round")


def check_checkpoints(record: dict[str, Any]) -> Check:
    """No checkpoint wiped: each killed replica's newest checkpoint is still there, or newer."""
    problems = []
    for event in record["events"]:
        before = event.get("checkpoints_before")
        if not before:
            continue
        after = record["replicas"][event["site"]]["checkpoints"]
        if not after or max(after) < max(before):
            problems.append(f"{event['site']}: had {before} before the kill, {after} at the end")
    steps = record["settings"]["steps"]
    for site, replica in record["replicas"].items():
        if replica["incarnations"][-1]["returncode"] == 0 and steps not in replica["checkpoints"]:
            problems.append(
                f"{site}: no final checkpoint at step {steps} ({replica['checkpoints']})"
            )
    if problems:
        return Check("no checkpoint wiped", False, "; ".join(problems))
    return Check("no checkpoint wiped", True, "every replica's newest checkpoint survived")


def loss_band(baseline_losses: list[float], slack: float) -> tuple[float, float]:
    """The run-to-run spread of drills without events, widened by ``slack`` times its width."""
    low, high = min(baseline_losses), max(baseline_losses)
    width = high - low
    return low - slack * width, high + slack * width


def mean_final_loss(record: dict[str, Any]) -> float | None:
    """A drill's final loss: the mean over its replicas that reported one (the same statistic
    for a drill and for the drills without events it is judged against)."""
    finals = [r["final_val_loss"] for r in record["replicas"].values() if r["final_val_loss"]]
    return statistics.mean(finals) if finals else None


def check_loss(record: dict[str, Any], baseline_losses: list[float], slack: float) -> Check:
    loss = mean_final_loss(record)
    if loss is None:
        return Check("final loss within the no-event spread", False, "no final loss")
    if len(baseline_losses) < 2:
        return Check(
            "final loss within the no-event spread", False,
            f"{loss:.4f}; a spread needs at least 2 drills without events, got {len(baseline_losses)}",
        )  # fmt: skip
    low, high = loss_band(baseline_losses, slack)
    passed = low <= loss <= high
    return Check(
        "final loss within the no-event spread", passed,
        f"{loss:.4f} against [{low:.4f}, {high:.4f}] (no-event drills "
        f"{', '.join(f'{x:.4f}' for x in baseline_losses)}, widened {slack:g} x their range)",
    )  # fmt: skip


def run_checks(
    record: dict[str, Any], baseline_losses: list[float] | None, slack: float = 1.0
) -> list[Check]:
    """Every check; the loss check only when ``baseline_losses`` is given."""
    checks = [check(record) for check in
              (check_completed, check_exits, check_same_model, check_metrics, check_checkpoints)]  # fmt: skip
    if baseline_losses is not None:
        checks.append(check_loss(record, baseline_losses, slack))
    return checks
