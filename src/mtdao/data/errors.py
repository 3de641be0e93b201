"""The one exception type for bad data inputs."""


class DataError(ValueError):
    """A corpus, tokenizer or batch request that cannot be served; the message names the input."""


INSTALL_DATA = 'pip install -c constraints.txt -e ".[data]"'
"""How to install what a Hugging Face data set or a BPE tokenizer needs (from a clone)."""
