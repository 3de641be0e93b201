"""The run's shared secret and the HMAC-SHA256 signatures made with it; a loopback run without one
uses this account's own secret (:func:`machine_secret`). Imports neither torch nor torchft."""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import stat
from pathlib import Path

TOKEN_ENV = "MTDAO_AUTH_TOKEN"
MIN_TOKEN_CHARS = 16
NO_TOKEN = b""  # anyone can sign with it: tests of the signatures only
MACHINE_SECRET_FILE = "loopback.secret"
MAKE_SECRET = "python -c 'import secrets; print(secrets.token_hex(32))' > FILE"

logger = logging.getLogger(__name__)


class RunKey:
    """HMAC-SHA256 signatures with the run's secret over fields; ``origin``: where it came from."""

    def __init__(self, secret: bytes, origin: str = "") -> None:
        self._secret = secret
        self.origin = origin

    @property
    def is_secret(self) -> bool:
        return self._secret != NO_TOKEN

    def sign(self, *fields: object) -> str:
        digest = hmac.new(self._secret, digestmod=hashlib.sha256)
        for value in fields:  # length-prefixed: ("ab", "c") and ("a", "bc") differ
            # surrogatepass: a lone surrogate (JSON's "\ud800") signs, it does not raise
            data = value if isinstance(value, bytes) else str(value).encode(errors="surrogatepass")
            digest.update(len(data).to_bytes(8, "big") + data)
        return digest.hexdigest()

    def verifies(self, signature: object, *fields: object) -> bool:
        # compare_digest raises on non-ASCII text: a peer's "é" is a wrong signature, not an error
        return (
            isinstance(signature, str)
            and signature.isascii()
            and hmac.compare_digest(signature, self.sign(*fields))
        )

    def __repr__(self) -> str:  # never print the secret
        return f"RunKey({'secret' if self.is_secret else 'no secret'})"


def read_token(token_file: str | None, environ=os.environ) -> bytes | None:
    """The run's secret from ``token_file``, else ``$MTDAO_AUTH_TOKEN``; None when neither."""
    if token_file is not None:
        source = f"--auth-token-file {token_file}"
        try:  # a pipe is fine (--auth-token-file <(pass show run)): SIGTERM still stops a wait
            data = Path(token_file).expanduser().read_bytes()
        except OSError as error:
            raise ValueError(
                f"{source}: {error.strerror}; give a file holding the run's secret"
            ) from None
    elif environ.get(TOKEN_ENV):
        source = f"${TOKEN_ENV}"
        data = environ[TOKEN_ENV].encode(errors="surrogateescape")  # its bytes as given
    else:
        return None
    try:
        text = data.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(
            f"{source} is not UTF-8 text: write the secret as text ({MAKE_SECRET})"
        ) from None
    if len(text) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{source} holds {len(text)} characters; a run's secret needs at least "
            f"{MIN_TOKEN_CHARS} (e.g. {MAKE_SECRET})"
        )
    return text.encode()


def run_key(token: bytes | None, bind_host: str, secret_dir: Path | None = None) -> RunKey:
    """The key of a replica serving on ``bind_host``: on loopback only, this account's secret
    stands in for a missing one."""
    if token is not None:
        return RunKey(token, "the run's secret")
    if not is_loopback(bind_host):
        raise ValueError(
            f"--bind-host {bind_host} serves other machines: give the run a secret with "
            f"--auth-token-file PATH or ${TOKEN_ENV} (the same on every replica)"
        )
    directory = secret_dir or machine_secret_dir()
    return RunKey(machine_secret(directory), f"this account's secret on this machine ({directory})")


def machine_secret_dir() -> Path:
    """``$XDG_CONFIG_HOME/mtdao`` (default ``~/.config/mtdao``)."""
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config).expanduser() / "mtdao"


def machine_secret(directory: Path) -> bytes:
    """This account's secret for loopback runs, ``directory``/loopback.secret, made on first use
    (0600 in a 0700 directory; the first one written wins); refused in one line when another
    account could read or replace it."""
    path = directory / MACHINE_SECRET_FILE
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        in_its_place = isinstance(error, FileExistsError | NotADirectoryError)
        fix = "a file is in its place: remove it" if in_its_place else error.strerror
        raise ValueError(
            f"cannot make {directory}, where replicas on loopback keep this account's secret "
            f"({fix}), or give the run a secret with --auth-token-file"
        ) from None
    _private(directory, "directory", 0o700)
    try:
        if not path.exists() and not path.is_symlink() and _make_secret(directory, path):
            logger.warning(
                "made this account's secret for loopback runs in %s (there was none): a "
                "lighthouse or replica that started before it holds a former one and cannot "
                "run with this process: restart them",
                path,
            )
        _private(path, "file", 0o600)
        secret = _read_regular_file(path).decode().strip()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or "it is not UTF-8 text"
        fix = (
            f"chmod 600 {path}, or delete it" if isinstance(error, PermissionError) else "delete it"
        )
        raise ValueError(
            f"cannot read this account's secret for loopback runs from {path}: {reason}; "
            f"{fix}, and the next replica or lighthouse makes a new one"
        ) from None
    if len(secret) < MIN_TOKEN_CHARS:
        raise ValueError(f"{path} holds no secret: delete it, and the next replica makes one")
    return secret.encode()


def _make_secret(directory: Path, path: Path) -> bool:
    """Write a new secret to ``path`` unless another process's is there first; whether this
    one made it."""
    draft = directory / f".{MACHINE_SECRET_FILE}.{os.getpid()}"
    descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_hex(32) + "\n")
    try:
        os.link(draft, path)  # fails if another replica's is there first: that one is used
        return True
    except FileExistsError:
        return False
    finally:
        draft.unlink()


def _read_regular_file(path: Path) -> bytes:
    """The bytes of a regular file ``path`` (else OSError EINVAL), opened without blocking: an
    open of a FIFO waits for a writer."""
    _refuse_irregular(path.lstat().st_mode)
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(descriptor, "rb") as file:
        _refuse_irregular(os.fstat(descriptor).st_mode)  # replaced since the check above
        return file.read()


def _refuse_irregular(mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise OSError(errno.EINVAL, f"it is {kind}")


def _private(path: Path, kind: str, mode: int) -> None:
    """Refuse ``path`` unless this account owns it and no other account can read or write it."""
    status = path.lstat()
    if stat.S_ISLNK(status.st_mode) or status.st_uid != os.geteuid():
        raise ValueError(
            f"{path}, where replicas on loopback keep this account's secret, is not this "
            "account's own; remove it, or give the run a secret with --auth-token-file"
        )
    if status.st_mode & 0o077:
        raise ValueError(
            f"the {kind} {path}, where replicas on loopback keep this account's secret, has "
            f"mode {stat.S_IMODE(status.st_mode):o}: other accounts could read it; "
            f"chmod {mode:o} {path}"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
