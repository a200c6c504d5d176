"""``mst.invert``: the compiled build (``mst._native_invert``) when :mod:`mst.native` chose it, else the
Python source ``mst/_invert.py`` (the single source of truth; read and edit that file). ``invert_ops`` is :mod:`mst.accel`'s wrapper
when the native path is on."""

from typing import TYPE_CHECKING

from mst.native import ACCEL, COMPILED

if TYPE_CHECKING or not COMPILED:
    from mst._invert import *  # noqa: F403
else:
    from mst._native_invert import *  # noqa: F403

if ACCEL and not TYPE_CHECKING:  # the native path in front (see mst.accel)
    import sys as _sys

    from mst.accel import accelerated_invert_ops, module

    _accel = module()
    _build = _sys.modules["mst._native_invert" if COMPILED else "mst._invert"]
    invert_ops = accelerated_invert_ops(_build.invert_ops, _accel)
