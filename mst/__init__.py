"""Repository core: strict DAG-CBOR, CIDs, CAR, K-256/P-256 keys, identifier syntax, TIDs, the
Merkle Search Tree with covering proofs and operation inversion, signed commits, the repo
producer and full-repo verification.

Everything here is pure and I/O-free (except the ``relay inspect`` CLI in ``mst.inspect``), and
every rejection is a :class:`mst.errors.RepoError` carrying a fixed snake_case ``reason``.
Module map: ``errors``, ``cbor``, ``cid``, ``car``, ``crypto``, ``syntax``, ``tid``,
``datamodel``, ``ops``, ``node`` (node codec + tree algorithms), ``mst`` (the ``MST`` value),
``diff``, ``proof``, ``invert``, ``commit``, ``repo``, ``verify``, ``inspect``; ``native`` (which
build of ``node``, ``invert`` and ``car`` runs: the one compiled at install, or the Python sources
``_node``, ``_invert``, ``_car``).
"""
