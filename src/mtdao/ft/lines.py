"""How the package words what it says: one line each, to standard error."""

from __future__ import annotations

import re
import socket
import sys


def first_line(error: BaseException, limit: int | None = None) -> str:
    """The first sentence of an error, without gloo's ``[path/file.cc:123] `` source location
    (``limit``: at most that many characters, for a peer's errors of unknown length)."""
    text = str(error).strip() or type(error).__name__
    return re.sub(r"^\[[^\]]*:\d+\]\s*", "", text.splitlines()[0]).split(". ")[0][:limit]


def short_member(member: str) -> str:
    """A torchft member id (or anything a peer claims) short enough for a line."""
    return member if len(member) <= 48 else member[:45] + "..."


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def shown_address(peer: tuple[str, int]) -> str:
    """A (host, port) as a line shows it (an IPv6 host in brackets)."""
    return f"[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"{peer[0]}:{peer[1]}"


def advertised_host(bind_host: str) -> str:
    """The address peers reach a listener on ``bind_host`` at (this host's name when it serves
    on every interface)."""
    host = bind_host.strip("[]")
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host
