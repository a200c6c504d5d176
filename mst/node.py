"""``mst.node``: the compiled build (``mst._native_node``) when :mod:`mst.native` chose it, else the
Python source ``mst/_node.py`` (the single source of truth; read and edit that file)."""

from typing import TYPE_CHECKING

from mst.native import COMPILED

if TYPE_CHECKING or not COMPILED:
    from mst._node import *  # noqa: F403
else:
    from mst._native_node import *  # noqa: F403
