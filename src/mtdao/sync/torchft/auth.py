"""The run's shared secret, and the signatures made with it.

Every replica of a fault-tolerant run holds the same secret (``--auth-token-file`` or the
``MTDAO_AUTH_TOKEN`` environment variable). What a replica tells its peers (who it is and where it
stands at a quorum) and the state it hands a healing peer carry an HMAC-SHA256 made with that
secret: a peer without it can neither claim a place in a round nor hand anyone a state. The secret
itself never travels. This module imports neither torch nor torchft.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from pathlib import Path

TOKEN_ENV = "MTDAO_AUTH_TOKEN"
MIN_TOKEN_CHARS = 16
NO_TOKEN = b""
"""The key of a run without a secret (loopback only): anyone on this machine can sign."""


class RunKey:
    """HMAC-SHA256 signatures with the run's secret over a sequence of fields."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    @property
    def is_secret(self) -> bool:
        return self._secret != NO_TOKEN

    def sign(self, *fields: object) -> str:
        digest = hmac.new(self._secret, digestmod=hashlib.sha256)
        for value in fields:  # length-prefixed: ("ab", "c") and ("a", "bc") differ
            data = value if isinstance(value, bytes) else str(value).encode()
            digest.update(len(data).to_bytes(8, "big") + data)
        return digest.hexdigest()

    def verifies(self, signature: object, *fields: object) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(signature, self.sign(*fields))

    def __repr__(self) -> str:  # never print the secret
        return f"RunKey({'secret' if self.is_secret else 'no secret'})"


def read_token(token_file: str | None, environ=os.environ) -> bytes | None:
    """The run's secret: the first line of ``token_file``, else ``$MTDAO_AUTH_TOKEN``; None when
    neither is set."""
    if token_file is not None:
        path = Path(token_file).expanduser()
        try:
            text = path.read_text().strip()
        except OSError as error:
            raise ValueError(f"--auth-token-file {token_file}: {error.strerror}") from None
        source = f"--auth-token-file {token_file}"
    elif environ.get(TOKEN_ENV):
        text, source = environ[TOKEN_ENV].strip(), f"${TOKEN_ENV}"
    else:
        return None
    if len(text) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{source} holds {len(text)} characters; a run's secret needs at least "
            f"{MIN_TOKEN_CHARS} (e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return text.encode()


def run_key(token: bytes | None, bind_host: str) -> RunKey:
    """The key of a replica serving on ``bind_host``: a secret is required unless it serves on
    loopback only."""
    if token is not None:
        return RunKey(token)
    if not is_loopback(bind_host):
        raise ValueError(
            f"--bind-host {bind_host} serves other machines: give the run a secret with "
            f"--auth-token-file PATH or ${TOKEN_ENV} (the same on every replica)"
        )
    return RunKey(NO_TOKEN)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
