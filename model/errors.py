"""The two ways a model can fail to load: it could not be fetched, or it is not what we run."""


class ModelFetchError(RuntimeError):
    """Downloading or converting a known model failed (network, checksum, unknown name)."""


class ModelFormatError(ValueError):
    """A directory or file is not a Llama model minipaged can load; the message says why."""
