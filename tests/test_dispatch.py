"""Implementation dispatch: reference fallback, interpret mode, and clear errors for missing kernels."""

import pytest

from kvjax.errors import UnknownImplError
from kvjax.ops import dispatch


def _ref(x):
    return ("reference", x)


def _kernel(x, *, interpret):
    return ("kernel", x, interpret)


@pytest.fixture
def toy_op():
    name = "toy_op_for_dispatch_test"
    dispatch.register_reference(name, _ref)
    dispatch.register_kernel(name, "pallas", f"{__name__}:_kernel", platforms=("gpu",))
    yield name
    dispatch._REFERENCES.pop(name)
    dispatch._KERNELS.pop(name)


def test_resolution_on_cpu(toy_op):
    assert dispatch.resolve(toy_op, "reference")(1) == ("reference", 1)
    assert dispatch.resolve(toy_op, "auto")(2) == ("reference", 2)  # CPU: the kernel is GPU-only
    assert dispatch.resolve(toy_op, "interpret")(3) == ("kernel", 3, True)
    assert dispatch.available(toy_op, "cpu") == ["reference", "interpret"]
    assert dispatch.available(toy_op, "gpu") == ["reference", "pallas", "interpret"]
    with pytest.raises(UnknownImplError, match="runs on .*gpu.*not on the current backend 'cpu'"):
        dispatch.resolve(toy_op, "pallas")
    with pytest.raises(UnknownImplError, match="no implementation 'triton'"):
        dispatch.resolve(toy_op, "triton")


def test_unknown_op_and_reserved_names():
    with pytest.raises(UnknownImplError, match="unknown op 'nope'"):
        dispatch.resolve("nope", "auto")
    with pytest.raises(ValueError, match="reserved"):
        dispatch.register_kernel("x", "auto", "m:f")
