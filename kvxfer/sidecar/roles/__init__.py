"""The roles a sidecar plays in KV transfers, each one class behind one interface
(:class:`~kvxfer.sidecar.roles.role.Role`) that the engine loop drives.

- ``role``: the interface, :class:`RoleEvents` and :class:`AbortOutcome`.
- ``prefill``: :class:`PrefillSide`, leases out (pull) and pushes out (push).
- ``pushes_out``: the prefill side's pushes into decode reservations.
- ``pull_decode``: :class:`PullDecode`, requests whose KV a decode READs from a lease.
- ``push_decode``: :class:`PushDecode`, reservations a prefill WRITEs into.
- ``claimers``: the prefills that claimed a push decode's reservations, and whether each
  still runs.
- ``composition``: :class:`Roles`, the roles of one instance over its ranks (``both``
  composes the prefill side and the decode's).
"""
