"""``mst.car``: the compiled build (``mst._native_car``) when :mod:`mst.native` chose it, else the
Python source ``mst/_car.py`` (the single source of truth; read and edit that file). ``read_car`` is :mod:`mst.accel`'s wrapper
when the native path is on."""

from typing import TYPE_CHECKING

from mst.native import ACCEL, COMPILED

if TYPE_CHECKING or not COMPILED:
    from mst._car import *  # noqa: F403
else:
    from mst._native_car import *  # noqa: F403

if ACCEL and not TYPE_CHECKING:  # the native path in front (see mst.accel)
    import sys as _sys

    from mst.accel import accelerated_read_car, module

    _accel = module()
    _build = _sys.modules["mst._native_car" if COMPILED else "mst._car"]
    read_car = accelerated_read_car(_build, _accel)
