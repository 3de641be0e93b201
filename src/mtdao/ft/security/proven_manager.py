"""A replica's torchft Manager whose quorum step holds proven members only and checks its heals
(docs/security.md, "What a peer must prove"): the first process proves the members, relaying the
verdict to the others through the replica's store."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from mtdao.ft.collective_watch import Peer
from mtdao.ft.identity import ReplicaIdentity
from mtdao.ft.lines import first_line, short_member
from mtdao.ft.plumbing import QuorumError, ReplicaRefused
from mtdao.ft.quorum_plan import QuorumPlan, plan_quorum, rendezvous
from mtdao.ft.refusals import Refusal
from mtdao.ft.security.heal_checks import heal_problem
from mtdao.ft.security.lighthouse_gate import lighthouse_min_replicas
from mtdao.ft.security.proofs import (
    Claim,
    SeenNonces,
    claim_data,
    confirm_quorum,
    new_nonce,
    quorum_digest,
    read_claim,
)
from mtdao.ft.security.safe_transport import HealBinding, HealRefused, Quorum
from mtdao.ft.security.torchft_internals import (
    REPLICA_ID_KEY,
    LighthouseClient,
    QuorumStepManager,
    create_store_client,
)

CONFIRM_WAIT_S = 5.0
"""How long a member waits for another's confirmation of a quorum (at most ``--connect-timeout``):
what a replayed claim, or a member that died since it asked, costs a quorum."""
RELAY = "mtdao/quorum"
KEPT = 1000
"""Refusals and notes kept for the replica's driver to say (a flood is counted, not kept)."""


class ProvenManager(QuorumStepManager):
    """torchft's ``Manager`` (``pg`` a ``GlooGroup``) with the module's quorum step, for the
    replica ``identity``; ``allow_non_finite``: whether a heal state may hold NaN/inf."""

    def __init__(
        self, *, identity: ReplicaIdentity, allow_non_finite: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.identity = identity
        self._lighthouse_addr = kwargs["lighthouse_addr"]
        self._store_address = f"{kwargs['store_addr']}:{kwargs['store_port']}"
        self._member = self.internals.store.get(REPLICA_ID_KEY).decode()  # <replica id>:<uuid>
        self._allow_non_finite = allow_non_finite
        self._confirm_wait_s = min(CONFIRM_WAIT_S, self.internals.connect_timeout.total_seconds())
        self._seen = SeenNonces()
        self._formed: tuple[int, tuple[str, ...]] | None = None  # the group's quorum id, members
        self._quorums = 0  # counted alike by every process of the replica: the relay's key
        self._stores: dict[str, Any] = {}
        self._stores_lock = threading.Lock()
        self._lighthouse: LighthouseClient | None = None
        self._min_replicas: int | None = None  # the lighthouse's, once it has told
        self._refused: set[str] = set()  # members whose heal state this process refused
        self._post()

    # -- the quorum ----------------------------------------------------------------------------

    def quorum_step(self, allow_heal: bool, shrink_only: bool, quorum_timeout: timedelta) -> None:
        self._quorums += 1
        relay = f"{RELAY}/{self._member}/{self._quorums}"
        if self.internals.group_rank == 0:
            try:
                verdict = self._proven_quorum(shrink_only, quorum_timeout)
            except Exception as error:
                self._write_signed(relay, {"error": f"{type(error).__name__}: {error}"})
                raise
            self._write_signed(relay, verdict)
        else:
            self.internals.store.wait(
                [relay], quorum_timeout + timedelta(seconds=self._confirm_wait_s)
            )
            verdict = self._read_signed(relay)
            if "error" in verdict:
                raise QuorumError(verdict["error"])
        proven = [Claim.from_fields(fields) for fields in verdict["proven"]]
        digest, quorum_id = verdict["digest"], verdict["quorum_id"]
        self.identity.quorum_id = quorum_id
        if verdict.get("failure"):  # this replica is in no proven round: it trains on alone
            self.identity.members, self.identity.rank = [self.identity.replica_id], 0
            self.report_error(RuntimeError(verdict["failure"]))
            return
        members = tuple(sorted(c.member for c in proven))
        meeting = rendezvous(self.identity.key, digest, proven)
        plan = plan_quorum(
            proven, self._member, self.internals.group_rank, meeting, verdict["min_replicas"]
        )
        self.identity.members, self.identity.rank = plan.replica_ids, plan.rank
        self.identity.peers = _peers(plan, self.internals.group_rank)
        self.internals.replica_rank = plan.rank
        self.internals.replica_world_size = len(plan.members)
        if not self._form_group(plan, digest, quorum_id, members):
            return
        if allow_heal:
            self._heal(plan, digest)

    def _proven_quorum(self, shrink_only: bool, quorum_timeout: timedelta) -> dict[str, Any]:
        """Ask the lighthouse for a quorum with this replica's signed claim; prove its members.
        The verdict, in plain data for the replica's other processes."""
        identity, key = self.identity, self.identity.key
        heal, refused_sources = self._posts()
        mine = Claim(
            replica_id=identity.replica_id,
            member=self._member,
            commits=self.internals.commits,
            step=identity.training_step,
            config=identity.config_digest,
            shards=self.internals.group_world_size,
            store=self._store_address,
            heal=heal,
            commit_failures=self.internals.commit_failures,
            nonce=new_nonce(),
            refused=refused_sources,
        )
        if self._lighthouse is None:
            self._lighthouse = LighthouseClient(
                self._lighthouse_addr, self.internals.connect_timeout
            )
        if self._min_replicas is None:  # asked again of a restarted lighthouse
            timeout = self.internals.connect_timeout.total_seconds()
            self._min_replicas = lighthouse_min_replicas(self._lighthouse_addr, timeout)
        try:
            quorum = self._lighthouse.quorum(
                replica_id=self._member,
                timeout=quorum_timeout,
                address=self.internals.server.address(),
                store_address=self._store_address,
                step=self.internals.commits,
                world_size=self.internals.group_world_size,
                shrink_only=shrink_only,
                data=claim_data(mine, key),
            )
        except Exception as error:
            self._lighthouse = self._min_replicas = None  # a restarted one: a new connection
            if "PermissionDenied" in str(error):  # the lighthouse's front refused it
                raise QuorumError(
                    f"the lighthouse at {self._lighthouse_addr} refused this replica's quorum "
                    f"request ({first_line(error, 160)}): an mtdao lighthouse refuses replicas "
                    "that do not prove the run's secret (is --auth-token-file / $MTDAO_AUTH_TOKEN "
                    "the one the lighthouse and the other replicas have?)"
                ) from None
            raise
        claims, refused, failure = [], [], "the lighthouse formed a quorum without this replica"
        for member in quorum.participants:
            claim, why = read_claim(member.replica_id, member.data, key)
            if member.replica_id == self._member:
                failure = "" if claim == mine else (
                    "another process asked the lighthouse for this quorum under this replica's "
                    "id (a replayed claim)"
                )  # fmt: skip
                continue
            if claim is not None and not self._seen.first_time(claim.nonce):
                claim, why = None, "its claim was handed in before (a replay)"
            if claim is None:
                name = member.replica_id.split(":")[0]
                shown = name if name.isdigit() else repr(short_member(name))
                refused.append(_refusal(shown, member.replica_id, why, f", step {member.step}"))
            else:
                claims.append(claim)
        identity.refused = (identity.refused + refused)[-KEPT:]  # the driver says them
        if not failure and self._min_replicas is None:
            failure = f"the lighthouse at {self._lighthouse_addr} did not say its --min-replicas"
        verdict = {
            "quorum_id": quorum.quorum_id,
            "failure": failure,
            "min_replicas": self._min_replicas,
        }
        if failure:
            return {**verdict, "digest": "", "proven": []}
        self._seen.first_time(mine.nonce)
        claims.append(mine)
        digest = quorum_digest(quorum.quorum_id, claims)
        try:
            unconfirmed = confirm_quorum(
                self._open_store, key, digest, mine, claims, self._confirm_wait_s
            )
        except Exception:  # this replica's own store did not answer: opened anew next time
            self._stores.pop(mine.store, None)
            raise
        proven = [c for c in claims if c.member not in unconfirmed]
        for claim in claims:
            if claim.member in unconfirmed:
                why = unconfirmed[claim.member]
                identity.refused.append(_refusal(claim.replica_id, claim.member, why))
                self._stores.pop(claim.store, None)  # opened anew next time (it may have failed)
        return {**verdict, "digest": digest, "proven": [json.loads(c.body()) for c in proven]}

    def _post(self) -> None:
        """Post in the replica's store what this process adds to the replica's claims: its heal
        server, and the members it refused a heal state from (no quorum heals from them again)."""
        post = {
            "heal": self.internals.heal_transport.metadata(),
            "refused": sorted(self._refused)[-KEPT:],
        }
        self._write_signed(self._post_key(self.internals.group_rank), post)

    def _posts(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The heal server of each process of this replica, in process order, and the members
        any of them refused (each process posts at start-up and at each refusal)."""
        posts = self._records_of_every_process(self._post_key, self.internals.timeout)
        refused = self._refused.union(*(post["refused"] for post in posts))
        return tuple(post["heal"] for post in posts), tuple(sorted(refused)[-KEPT:])

    def _records_of_every_process(self, key_of, timeout: timedelta) -> list[dict[str, Any]]:
        """The signed record each process of this replica wrote at ``key_of(its rank)``, in
        process order, once all are there (at most ``timeout``)."""
        keys = [key_of(rank) for rank in range(self.internals.group_world_size)]
        self.internals.store.wait(keys, timeout)
        return [self._read_signed(key) for key in keys]

    def _post_key(self, group_rank: int) -> str:
        return f"mtdao/process/{self._member}/{group_rank}"

    def _write_signed(self, key: str, record: dict[str, Any]) -> None:
        """Write ``record`` at ``key`` of this replica's store, signed for that key: anyone who
        reaches the store (a TCPStore: no credentials) can write there, only the run signs."""
        body = json.dumps(record)
        signed = {"body": body, "sig": self.identity.key.sign("store", key, body)}
        self.internals.store.set(key, json.dumps(signed))

    def _read_signed(self, key: str) -> dict[str, Any]:
        """The record this replica's processes wrote at ``key``; QuorumError (this quorum fails,
        the next asks again) where another process wrote it: a ValueError would stop this
        replica as if it were refused."""
        try:
            signed = json.loads(self.internals.store.get(key))
            if self.identity.key.verifies(signed["sig"], "store", key, signed["body"]):
                return json.loads(signed["body"])
        except (ValueError, TypeError, KeyError, RecursionError):  # not even a signed record
            pass
        raise QuorumError(
            f"the record {key!r} in this replica's store at {self._store_address} is not signed "
            "by its processes: another process that reaches the store wrote it? (firewall the "
            "store's port to the run's machines)"
        )

    def _open_store(self, address: str) -> Any:
        """A client of the store at ``host:port`` (kept while its member confirms quorums)."""
        with self._stores_lock:
            store = self._stores.get(address)
        if store is None:
            timeout = timedelta(seconds=self._confirm_wait_s)
            store = create_store_client(f"{address}/", timeout)
            with self._stores_lock:
                self._stores[address] = store
        return store

    # -- the group -----------------------------------------------------------------------------

    def _form_group(
        self, plan: QuorumPlan, digest: str, quorum_id: int, members: tuple[str, ...]
    ) -> bool:
        """Form the round's group when the membership changed or a member failed a round;
        False when this quorum cannot hold a round (the failure reported to torchft)."""
        if plan.refusal is not None:  # this replica leaves: the others fail their round now
            self.identity.refusal = ReplicaRefused(plan.refusal)
            if plan.failure is None:  # they form a group with it: join it, then leave at once
                with contextlib.suppress(Exception):
                    self._configure(plan, digest)
                self.internals.process_group.abort(errored=False)
            # its store keeps its confirmation for those still reading it: gone at once, some
            # would prove it and some not, and they would meet apart and lose the round waiting
            time.sleep(self._confirm_wait_s)
            return False
        if plan.failure is not None:
            self.report_error(RuntimeError(plan.failure))
            return False
        failures = any(c.commit_failures for c in plan.members)
        if not failures and self._formed == (quorum_id, members):
            return True
        self._formed = None
        try:
            self._configure(plan, digest)
        except Exception as error:  # a member that proved itself did not come in time
            self.report_error(error)
            return False
        self._formed = (quorum_id, members)
        return True

    def _configure(self, plan: QuorumPlan, digest: str) -> None:
        self.internals.quorum_id = int(digest[:15], 16)
        group_world = self.internals.group_world_size
        self.internals.process_group.configure(
            f"{plan.store}/{self.internals.group_rank}",
            self._member,
            plan.rank,
            len(plan.members),
            self.internals.quorum_id,
            self.internals.group_rank,
            group_world,
            [c.replica_id * group_world + self.internals.group_rank for c in plan.members],
        )

    # -- the heal ------------------------------------------------------------------------------

    def _heal(self, plan: QuorumPlan, digest: str) -> None:
        transport = self.internals.heal_transport
        receivers = frozenset(c.member for c in plan.members)
        transport.open(Quorum(digest, self._member, self.internals.group_rank, receivers))
        if plan.serves:
            transport.serve(plan.max_commits, self.internals.state_to_serve())
        if not plan.heals:  # (at a first quorum, some processes of a replica heal, some not)
            self._every_process_fits(plan, True)
            return
        self.internals.healing = True
        state = self._fetch_heal(plan, digest)
        if not self._every_process_fits(plan, state is not None):  # the replica keeps its own
            why = "no proven source sent a state that fits this replica"  # a later round heals it
            if state is not None:
                why = "another process of this replica refused the state its source sent"
            self.report_error(HealRefused(why))
            self.internals.process_group.abort()  # its peers fail this round now, not later
            return
        self.internals.pending_state_dict = state
        self.load_state_dict(state["torchft"])
        self.internals.commits = plan.max_commits

    def _every_process_fits(self, plan: QuorumPlan, fits: bool) -> bool:
        """Whether every process of this replica received a state that fits (``fits``: this
        one's; one that does not heal says so and waits for none): a replica heals whole or not
        at all, since a process that loaded its source's step beside one that kept its own would
        part the replica's own collectives."""
        if self.internals.group_world_size == 1:
            return fits
        prefix = f"mtdao/heal/{self._member}/{self._quorums}"
        self._write_signed(f"{prefix}/{self.internals.group_rank}", {"fits": fits})
        if not plan.heals:
            return fits
        # the others try as many sources as this one, each for at most the collective timeout
        timeout = self.internals.timeout * (len(plan.sources) + 1)
        records = self._records_of_every_process(lambda rank: f"{prefix}/{rank}", timeout)
        return all(record.get("fits") is True for record in records)

    def _fetch_heal(self, plan: QuorumPlan, digest: str) -> dict[str, Any] | None:
        """The first state one of ``plan``'s sources sends that fits this replica, or None."""
        mine = plan.members[plan.rank]
        own: dict[str, Any] | None = None
        for index in plan.sources:
            source = plan.members[index]
            peer = f"replica {source.replica_id} ({short_member(source.member)})"
            if len(source.heal) <= self.internals.group_rank:
                self._note(f"not healing from {peer}: it names no heal server for process "
                           f"{self.internals.group_rank}")  # fmt: skip
                continue
            binding = HealBinding(
                digest, source.member, self._member, self.internals.group_rank, plan.max_commits
            )
            try:
                state = self.internals.heal_transport.fetch(
                    source.heal[self.internals.group_rank], binding, peer
                )
            except HealRefused as refused:
                self._note(f"{refused}; trying the next source")
                continue
            if own is None:
                own = {
                    key: state_dict() for key, state_dict in self.internals.user_state_dicts.items()
                }
            # a source of another config: no source has this replica's, so it differs (its
            # config check names the differences and refuses it), once the records are sound
            same_config = source.config == mine.config
            problem = heal_problem(
                state, own, source.commits, source.step, self._allow_non_finite, same_config
            )
            if problem is None:
                return state
            self._refused.add(source.member)
            self._post()
            self._note(
                f"refused the heal state of {peer}: {problem}; this replica keeps its own state "
                "and heals from it no more"
            )
        return None

    def _note(self, line: str) -> None:
        if self.internals.group_rank == 0:
            self.identity.notes = [*self.identity.notes[-KEPT:], line]


def _refusal(replica: object, member: str, why: str, step: str = "") -> Refusal:
    """A quorum member that proved nothing, as it presents itself (``step``: what it claims)."""
    line = (
        f"the peer claiming replica id {replica} ({short_member(member)}{step}): {why}; it is "
        "not averaged with nor healed from"
    )
    return Refusal(peer=member, line=line)


def _peers(plan: QuorumPlan, group_rank: int) -> list[Peer]:
    """The other members' counterparts of this process, at their heal servers."""
    peers = []
    for rank, claim in enumerate(plan.members):
        if rank != plan.rank and group_rank < len(claim.heal):
            address = urlsplit(claim.heal[group_rank])
            if address.hostname and address.port:
                peers.append(Peer(claim.replica_id, address.hostname, address.port))
    return peers
