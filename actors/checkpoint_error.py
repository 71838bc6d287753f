"""The error a bad checkpoint folder raises, in a module of its own so that what
reports it (the command line) need not import torch to name it."""


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, incomplete, corrupt or unsupported."""
