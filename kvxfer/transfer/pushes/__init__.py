"""Push mode, a prefill rank's side: WRITEs of a request's KV into a decode's reservation.

:mod:`~kvxfer.transfer.pushes.targets` handshakes and connects the decode engines;
:mod:`~kvxfer.transfer.pushes.pusher` posts each request's WRITEs, layer group by layer
group, and its signed "done". The decode's side is a lease held on its own blocks
(:class:`~kvxfer.transfer.leases.LeaseTable`), ended by the writers' "done".
"""
