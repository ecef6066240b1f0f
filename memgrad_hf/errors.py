"""Exceptions raised by memgrad_hf."""


class UnsupportedModelError(ValueError):
    """A model (or an option of it) that memgrad_hf cannot patch without changing results.

    The message names the model class and what is missing; memgrad_hf never falls back silently. (Not a TypeError:
    torch turns a TypeError raised inside a tensor's binary operator, such as ``logits + bias`` on the logits probe,
    into ``NotImplemented``, and the message would be lost.)
    """
