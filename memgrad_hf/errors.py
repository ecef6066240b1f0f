"""Exceptions raised by memgrad_hf."""


class UnsupportedModelError(TypeError):
    """A model (or an option of it) that memgrad_hf cannot patch without changing results.

    The message names the model class and what is missing; memgrad_hf never falls back silently.
    """
