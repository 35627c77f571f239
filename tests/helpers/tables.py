"""Backend-table checks shared by the op tests."""

from __future__ import annotations

from kvjax.base.device import NAMED


def assert_auto_choices(table, want: dict[str, str]) -> None:
    """``table``'s examples are exactly ``want``'s keys, ``auto`` takes ``want[name]`` for each on an H100 and the
    reference on a CPU."""
    assert set(table.examples) == set(want)
    for name, make_call in table.examples.items():
        args, kwargs = make_call()
        assert table.choose("auto", args, kwargs, NAMED["h100"])[0] == want[name], name
        assert table.choose("auto", args, kwargs, NAMED["cpu"])[0] == "reference", name
