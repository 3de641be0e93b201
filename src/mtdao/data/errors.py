"""The one exception type for bad data inputs."""


class DataError(ValueError):
    """A corpus, tokenizer or batch request that cannot be served; the message names the input."""
