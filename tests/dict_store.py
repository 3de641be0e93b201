"""A dict in place of the c10d store that quorum confirmations are posted to (no processes)."""


class DictStore:
    """The part of a c10d store the quorum confirmations use."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def wait(self, keys, timeout) -> None:
        missing = [k for k in keys if k not in self.values]
        if missing:
            raise TimeoutError(f"{missing} not set")
