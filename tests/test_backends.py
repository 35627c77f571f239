"""Backend tables: priority order, unsupported() reasons, prefer() rules, device checks, interpret mode and clear
errors."""

import jax
import pytest

from kvjax.base.device import NAMED, DeviceKind
from kvjax.errors import UnknownImplError
from kvjax.ops.backends import Backend, BackendTable, lazy, on_hopper


def _ref(x):
    return ("reference", x)


def _fast(x, *, interpret):
    return ("fast", x, interpret)


def _slow(x, *, interpret):
    return ("slow", x, interpret)


def _fast_unsupported(x):
    return None if x < 100 else f"x={x} is too large for the fast kernel"


TABLE = BackendTable(
    "toy",
    _ref,
    (
        Backend("pallas", _slow, priority=10),
        Backend("mosaic", _fast, priority=20, device=on_hopper, unsupported=_fast_unsupported),
    ),
)


def test_auto_takes_the_first_backend_that_accepts():
    assert TABLE.choose("auto", (1,), {}, NAMED["h100"])[1](1) == ("fast", 1, False)
    assert TABLE.choose("auto", (500,), {}, NAMED["h100"])[1](500) == ("slow", 500, False)
    assert TABLE.choose("auto", (1,), {}, NAMED["a100"])[0] == "pallas"
    assert TABLE.choose("auto", (1,), {}, NAMED["cpu"])[0] == "reference"
    reasons = dict(TABLE.explain((500,), {}, NAMED["h100"]))
    assert reasons == {"mosaic": "x=500 is too large for the fast kernel", "pallas": None, "reference": None}
    assert "needs a Hopper" in dict(TABLE.explain((1,), {}, NAMED["a100"]))["mosaic"]


def _big_preferred(x):
    return None if x >= 10 else f"x={x} is below 10, where it was measured slower"


PREFER_TABLE = BackendTable(
    "toy-prefer",
    _ref,
    (
        Backend("pallas", _slow, priority=10),
        Backend("mosaic", _fast, priority=20, device=on_hopper, unsupported=_fast_unsupported,
                prefer=_big_preferred),
    ),
)


def test_prefer_declines_for_auto_only():
    """A backend whose ``prefer`` rule declines is passed over by ``auto`` (explain says why) but taken by name; its
    ``unsupported`` and device checks still come first, for ``auto`` and by name."""
    h100 = NAMED["h100"]
    assert PREFER_TABLE.choose("auto", (50,), {}, h100)[1](50) == ("fast", 50, False)
    assert PREFER_TABLE.choose("auto", (3,), {}, h100)[1](3) == ("slow", 3, False)
    reasons = dict(PREFER_TABLE.explain((3,), {}, h100))
    assert reasons == {"mosaic": "auto passes it over: x=3 is below 10, where it was measured slower",
                       "pallas": None, "reference": None}
    assert dict(PREFER_TABLE.explain((50,), {}, h100))["mosaic"] is None
    name, fn = PREFER_TABLE.choose("mosaic", (3,), {}, h100)
    assert (name, fn(3)) == ("mosaic", ("fast", 3, False))
    assert PREFER_TABLE("mosaic:interpret", 3) == ("fast", 3, True)
    assert dict(PREFER_TABLE.explain((500,), {}, h100))["mosaic"] == "x=500 is too large for the fast kernel"
    assert "needs a Hopper" in dict(PREFER_TABLE.explain((50,), {}, NAMED["a100"]))["mosaic"]
    assert PREFER_TABLE.choose("auto", (50,), {}, NAMED["a100"])[0] == "pallas"
    with pytest.raises(UnknownImplError, match="too large"):
        PREFER_TABLE.choose("mosaic", (500,), {}, h100)


def test_named_and_interpret():
    assert TABLE.choose("reference", (3,), {})[1](3) == ("reference", 3)
    assert TABLE("interpret", 3) == ("slow", 3, True)
    assert TABLE("mosaic:interpret", 3) == ("fast", 3, True)
    with pytest.raises(UnknownImplError, match="too large"):
        TABLE("mosaic:interpret", 300)
    if jax.default_backend() == "cpu":
        with pytest.raises(UnknownImplError, match="needs a GPU"):
            TABLE("pallas", 3)
    with pytest.raises(UnknownImplError, match="no implementation 'triton'"):
        TABLE("triton", 3)
    with pytest.raises(UnknownImplError, match="NAME:interpret"):
        TABLE.validate_impl("pallas:fast")
    with pytest.raises(UnknownImplError, match="must be a string"):
        TABLE.validate_impl(None)
    assert TABLE.available(NAMED["cpu"]) == ["reference", "mosaic:interpret", "pallas:interpret"]
    assert TABLE.available(NAMED["h100"])[:3] == ["reference", "mosaic", "pallas"]


def test_bad_tables_and_devices():
    with pytest.raises(ValueError, match="reserved"):
        Backend("auto", _fast, priority=1)
    with pytest.raises(ValueError, match="fn must be a function"):
        Backend("x", "nomodule:f", priority=1)
    with pytest.raises(ValueError, match="prefer must be a function"):
        Backend("x", _fast, priority=1, prefer="faster")
    with pytest.raises(ValueError, match="module:function"):
        lazy("nomodule")
    assert lazy("math:hypot")(3.0, 4.0) == 5.0  # imported at the call
    with pytest.raises(ValueError, match="repeat"):
        BackendTable("t", _ref, (Backend("a", _fast, 1), Backend("a", _slow, 2)))
    with pytest.raises(ValueError, match="platform"):
        DeviceKind("cuda")
    with pytest.raises(ValueError, match="num_sms"):
        DeviceKind("gpu", "9.0", 0)
