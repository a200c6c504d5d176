"""``mst.car``: the compiled build (``mst._native_car``) when :mod:`mst.native` chose it, else the
Python source ``mst/_car.py`` (the single source of truth; read and edit that file)."""

from typing import TYPE_CHECKING

from mst.native import COMPILED

if TYPE_CHECKING or not COMPILED:
    from mst._car import *  # noqa: F403
else:
    from mst._native_car import *  # noqa: F403
