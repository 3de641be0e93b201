"""Scenarios of ``mtdao wan-drill``: the sites' links and timed events, from a JSON or YAML file.

    links:                      # every site's link; per-site entries override the default
      default: {rate_mbit: 100, delay_ms: 20, jitter_ms: 1, loss: 0.0005}
      r2: {delay_ms: 60}        # a far site
    replica_flags: []           # extra `mtdao train` flags of every replica; {site}, {address}
    lighthouse_flags: []        # and {hostname} become the process's own (e.g. --sync-delay 2)
    events:                     # at_s: seconds after every replica's first step, or at_step:
                                # when the most advanced replica reaches that step
      - {at_s: 20, kind: kill, site: r1, for_s: 5}           # SIGKILL, restart (--resume) after 5 s
      - {at_s: 40, kind: partition, site: r2, for_s: 10}     # every frame dropped, then healed
      - {at_s: 60, kind: slow_link, site: r0, for_s: 10, rate_factor: 0.1}
      - {at_s: 80, kind: straggler, site: r1, for_s: 15, cpu_share: 0.2}
      - {at_s: 100, kind: lighthouse_restart, for_s: 3}      # SIGKILL the lighthouse, restart

Sites are ``lighthouse`` and ``r0`` .. ``r{replicas-1}``. :data:`DEFAULT_SCENARIO` exercises each
event once (``full`` is another name for it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mtdao.testing.network.sites import LinkSpec

EVENT_KINDS = ("kill", "partition", "slow_link", "straggler", "lighthouse_restart")
LIGHTHOUSE = "lighthouse"


@dataclass(frozen=True)
class Event:
    kind: str
    """One of :data:`EVENT_KINDS`."""
    at_s: float | None = None
    """Seconds after every replica has taken its first step; or"""
    at_step: int | None = None
    """when the most advanced replica reaches this step (robust to the machine's speed)."""
    site: str = LIGHTHOUSE
    """The replica site it strikes (``lighthouse`` for a lighthouse restart)."""
    for_s: float = 10.0
    """How long it lasts: down time before a restart, or the partition's, slow link's or
    straggler's duration."""
    rate_factor: float = 0.1
    """slow_link: the link's rate is multiplied by this."""
    cpu_share: float = 0.2
    """straggler: the fraction of one CPU its processes get."""

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"event kind must be one of {', '.join(EVENT_KINDS)}: {self.kind!r}")
        if (self.at_s is None) == (self.at_step is None):
            raise ValueError(f"event {self.kind}: give exactly one of at_s and at_step")
        if not (self.at_s or 0) >= 0 or not (self.at_step or 0) >= 0 or not self.for_s >= 0:
            raise ValueError(f"event {self.kind}: at_s, at_step and for_s must be >= 0")
        if self.kind == "lighthouse_restart" and self.site != LIGHTHOUSE:
            raise ValueError(f"lighthouse_restart strikes the lighthouse, not {self.site!r}")
        if self.kind != "lighthouse_restart" and self.site == LIGHTHOUSE:
            raise ValueError(f"event {self.kind} needs a replica site (r0, r1, ...)")
        if not 0 < self.rate_factor <= 1:
            raise ValueError(f"rate_factor must be in (0, 1], got {self.rate_factor}")
        if not 0 < self.cpu_share <= 1:
            raise ValueError(f"cpu_share must be in (0, 1], got {self.cpu_share}")

    @property
    def when(self) -> str:
        return f"{self.at_s:g} s" if self.at_s is not None else f"step {self.at_step}"

    @property
    def label(self) -> str:
        return f"{self.kind} {self.site}" if self.site != LIGHTHOUSE else self.kind


@dataclass(frozen=True)
class Scenario:
    name: str
    events: tuple[Event, ...] = ()
    links: dict[str, LinkSpec] = field(default_factory=dict)
    """Per-site links; ``default`` for every site not named."""
    replica_flags: tuple[str, ...] = ()
    lighthouse_flags: tuple[str, ...] = ()

    def link(self, site: str) -> LinkSpec:
        return self.links.get(site, self.links.get("default", LinkSpec()))

    def check_sites(self, replicas: int) -> None:
        """Every event and link names a site of a drill of ``replicas`` replicas."""
        sites = {LIGHTHOUSE, "default", *(f"r{i}" for i in range(replicas))}
        for name in [*self.links, *(event.site for event in self.events)]:
            if name not in sites:
                raise ValueError(
                    f"scenario {self.name}: site {name!r} is not one of a {replicas}-replica "
                    f"drill's ({', '.join(sorted(sites - {'default'}))})"
                )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "events": [vars(event) for event in self.events],
            "links": {site: vars(link) for site, link in self.links.items()},
            "replica_flags": list(self.replica_flags),
            "lighthouse_flags": list(self.lighthouse_flags),
        }


def scenario_from_dict(data: dict[str, Any], name: str) -> Scenario:
    known = {"name", "events", "links", "replica_flags", "lighthouse_flags"}
    unknown = set(data) - known
    if unknown:
        raise ValueError(
            f"scenario {name}: unknown keys {sorted(unknown)} (known: {sorted(known)})"
        )
    default = _build(LinkSpec, data.get("links", {}).get("default", {}), f"{name}: links.default")
    links = {"default": default}
    for site, values in data.get("links", {}).items():
        if site != "default":
            merged = {**vars(default), **(values or {})}
            links[site] = _build(LinkSpec, merged, f"{name}: links.{site}")
    events = tuple(
        _build(Event, values, f"{name}: events[{i}]")
        for i, values in enumerate(data.get("events") or [])
    )
    return Scenario(
        name=str(data.get("name", name)),
        events=events,
        links=links,
        replica_flags=tuple(str(flag) for flag in data.get("replica_flags") or ()),
        lighthouse_flags=tuple(str(flag) for flag in data.get("lighthouse_flags") or ()),
    )


def _build(cls, values: dict[str, Any], where: str):
    if not isinstance(values, dict):
        raise ValueError(f"scenario {where}: expected a mapping, got {values!r}")
    names = {f.name for f in fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(
            f"scenario {where}: unknown keys {sorted(unknown)} (known: {sorted(names)})"
        )
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"scenario {where}: {error}") from None


def load_scenario(path: str) -> Scenario:
    """A scenario file (``.json``, ``.yaml``/``.yml``), or ``default``/``full``/``none``."""
    if path in BUILT_IN:
        return BUILT_IN[path]
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"scenario file {path} does not exist (or use {', '.join(BUILT_IN)})"
        )
    text = file.read_text()
    if file.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"scenario {path}: expected a mapping at the top")
    return scenario_from_dict(data, file.stem)


_DEFAULT_EVENTS = [  # at steps of the default 1280 (a machine's speed varies), apart by more
    # than a heal takes, so that each event's cost is its own. The lighthouse restart comes
    # first: while it is away the replicas skip their rounds and race ahead, so it needs many
    # steps after it for the restarted lighthouse to be back before the run ends
    {"at_step": 96, "kind": "lighthouse_restart", "for_s": 3},
    {"at_step": 352, "kind": "kill", "site": "r1", "for_s": 4},
    {"at_step": 608, "kind": "partition", "site": "r2", "for_s": 15},
    {"at_step": 864, "kind": "slow_link", "site": "r0", "for_s": 10, "rate_factor": 0.1},
    # a share below what a process gets on a busy machine anyway (two cores, several runs)
    {"at_step": 1056, "kind": "straggler", "site": "r1", "for_s": 15, "cpu_share": 0.05},
]
DEFAULT_SCENARIO = scenario_from_dict({"name": "default", "events": _DEFAULT_EVENTS}, "default")
NO_EVENTS = scenario_from_dict({"name": "none"}, "none")
BUILT_IN = {"default": DEFAULT_SCENARIO, "full": DEFAULT_SCENARIO, "none": NO_EVENTS}
