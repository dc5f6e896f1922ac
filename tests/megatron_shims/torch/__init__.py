"""SHIM (tests only), not torch: the names Megatron's client and server files use at import.

``inference_request.py`` names ``torch.Tensor`` and ``torch.dtype`` in annotations that run
at import, and a few dtypes in a function that lists its metadata's types; nothing here
computes, and no value the tests send is a tensor. The released megatron-core (0.16.1)
turns a reply's ``["tensor", values]`` into ``torch.tensor(values)``: here, the list.
"""


class Tensor:
    """Stands in for ``torch.Tensor``: no value is ever one."""


class dtype:  # noqa: N801 - torch's name
    """Stands in for ``torch.dtype``: a name only."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


float32 = dtype("float32")
int32 = dtype("int32")
int64 = long = dtype("int64")
bool = dtype("bool")  # noqa: A001 - torch's name


def tensor(data, **options):
    """Stands in for ``torch.tensor``: the values, as a list."""
    return list(data)
