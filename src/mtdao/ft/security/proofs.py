"""Who is in a quorum, proven: a claim signed with the run's secret with a fresh nonce, and a
confirmation of this very quorum in the member's own store, since a claim is public once a quorum
carried it (docs/security.md, "What a peer must prove")."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from mtdao.ft.lines import first_line, short_member
from mtdao.ft.security.auth import RunKey

DATA_KEY = "mtdao"  # where a claim travels in a member's quorum request (torchft's ``data``)


@dataclass(frozen=True)
class Claim:
    replica_id: int  # the replica's ``--replica-id``
    member: str  # torchft's id of this replica's manager (``<replica id>:<uuid>``)
    commits: int  # torchft's step: rounds this replica committed
    step: int  # the training step this replica has taken
    config: str  # digest of the settings every replica must share
    shards: int  # the replica's processes (``--shards``)
    store: str  # ``host:port`` of the replica's store (its confirmations, and a round's rendezvous)
    heal: tuple[str, ...]  # the heal server of each of its processes, in process order
    commit_failures: int = 0  # rounds failed in a row (the round's group is rebuilt then)
    nonce: str = ""  # drawn for this one quorum request
    refused: tuple[str, ...] = ()  # members whose heal state it refused: none heals from them

    def body(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> Claim:
        """The claim of a peer's JSON ``fields``, each of its field's type (an int of 64 bits, no
        bool or float; heal servers as http://HOST[:PORT] URLs); TypeError or ValueError naming
        the first field that is not: every member plans its quorum over them."""
        if not isinstance(fields, dict):
            raise TypeError(f"it is {_kind(fields)}, not an object")
        for field in dataclasses.fields(cls):
            if field.name in fields:
                _check_field(field.name, field.type, fields[field.name])
            elif field.default is dataclasses.MISSING:
                raise TypeError(f"it has no {field.name}")
        unknown = sorted(set(fields) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"{unknown[0][:40]!r} is no field of a claim")
        heal, refused = tuple(fields["heal"]), tuple(fields.get("refused", ()))
        return cls(**{**fields, "heal": heal, "refused": refused})


def _check_field(name: str, kind: str, value: Any) -> None:
    """Raise TypeError or ValueError, naming ``name``, unless ``value`` is of ``kind`` (a
    field's annotation)."""
    if kind == "int":
        if type(value) is not int or not -(2**63) <= value < 2**63:  # torchft's steps are i64
            raise TypeError(f"{name} is {_kind(value)}, not an int of 64 bits")
    elif kind == "str":
        if type(value) is not str:
            raise TypeError(f"{name} is {_kind(value)}, not text")
    elif kind == "tuple[str, ...]":
        if type(value) is not list or any(type(item) is not str for item in value):
            raise TypeError(f"{name} is {_kind(value)}, not a list of text")
        if name == "heal":
            for url in value:
                _check_heal_url(url)
    else:
        raise AssertionError(f"a claim's {name} ({kind}) is read unchecked")


def _check_heal_url(url: str) -> None:
    """ValueError unless ``url`` is http://HOST[:PORT] with a port that parses (each member
    reads its peers' heal servers from their claims)."""
    try:
        address = urlsplit(url)  # .port raises ValueError for one out of range or no number
        usable = address.scheme == "http" and bool(address.hostname) and address.port != 0
    except ValueError:
        usable = False
    if not usable:
        raise ValueError(f"heal holds {url[:60]!r}, not an http://HOST:PORT URL")


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def new_nonce() -> str:
    return secrets.token_hex(16)


def claim_data(claim: Claim, key: RunKey) -> dict[str, str]:
    """The ``data`` of a quorum request carrying ``claim``, signed."""
    body = claim.body()
    return {DATA_KEY: json.dumps({"claim": body, "sig": key.sign("claim", body)})}


def read_claim(member_id: str, data: Any, key: RunKey) -> tuple[Claim | None, str]:
    """(the claim quorum member ``member_id`` sent, "") or (None, why it proves nothing)."""
    posted = data.get(DATA_KEY) if isinstance(data, dict) else None
    if posted is None:
        return None, "it sent no claim (not an mtdao replica of this run)"
    try:  # RecursionError: nested too deep
        posted = json.loads(posted)
        body, signature = posted["claim"], posted["sig"]
        if not key.verifies(signature, "claim", body):
            return None, "its claim is not signed with this run's secret"
        fields = json.loads(body)  # read only once it is signed
    except (TypeError, ValueError, KeyError, RecursionError):
        return None, "its claim is not readable"
    try:
        claim = Claim.from_fields(fields)
    except (TypeError, ValueError) as error:  # a faulty member's: the field is named
        return None, f"its claim is not readable ({error})"
    if claim.member != member_id:
        return None, f"its claim was made by another member ({short_member(claim.member)})"
    return claim, ""


class SeenNonces:
    """The newest ``limit`` nonces read: a replayed claim repeats one, a member's own never do."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self._seen: OrderedDict[str, None] = OrderedDict()

    def first_time(self, nonce: str) -> bool:
        if not nonce or nonce in self._seen:
            return False
        self._seen[nonce] = None
        if len(self._seen) > self.limit:
            self._seen.popitem(last=False)
        return True


def quorum_digest(quorum_id: int, claims: Sequence[Claim]) -> str:
    """What binds everything signed in one quorum to it: the lighthouse's quorum id (which a
    restarted lighthouse repeats) and every candidate's nonce (which nobody repeats)."""
    digest = hashlib.sha256()
    for field in [str(quorum_id), *sorted(f"{c.member}|{c.nonce}" for c in claims)]:
        data = field.encode()  # length-prefixed: no two lists of fields hash alike
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


def confirm_quorum(
    open_store: Callable[[str], Any],
    key: RunKey,
    digest: str,
    me: Claim,
    candidates: Sequence[Claim],
    wait_s: float,
) -> dict[str, str]:
    """Post this member's confirmation of ``digest`` (under a key only the secret's holders can
    name), then read every other candidate's from its claimed store for at most ``wait_s``:
    {member: why not} for those not confirmed."""
    name = f"mtdao/confirm/{key.sign('confirmation key', digest)[:32]}"
    open_store(me.store).set(name, key.sign("confirm", digest, me.member))
    others = [c for c in candidates if c.member != me.member]

    def confirmation(claim: Claim) -> str:
        try:
            store = open_store(claim.store)
            store.wait([name], timedelta(seconds=wait_s))
            signature = store.get(name).decode()
        except Exception as error:  # unreachable, or nothing posted in time
            return f"it did not confirm this quorum within {wait_s:g} s ({first_line(error, 120)})"
        if not key.verifies(signature, "confirm", digest, claim.member):
            return "its confirmation of this quorum is not signed with this run's secret"
        return ""

    if not others:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(others))) as pool:
        verdicts = list(pool.map(confirmation, others))
    return {c.member: why for c, why in zip(others, verdicts) if why}
