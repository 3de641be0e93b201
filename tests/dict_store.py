"""A dict in place of the c10d store that quorum confirmations are posted to (no processes)."""

import time


class DictStore:
    """The part of a c10d store the quorum confirmations use."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def wait(self, keys, timeout) -> None:
        """Until every key is set (by another thread), at most ``timeout``."""
        deadline = time.monotonic() + timeout.total_seconds()
        while missing := [k for k in keys if k not in self.values]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{missing} not set")
            time.sleep(0.005)
