"""One rank's transfer machinery. Modules and packages:

- ``transfer_config``: ``TransferConfig``, every transfer setting in one typed place;
- ``ranks``: ``Ranks``, one process's workers, reports, shares and heartbeats;
- ``worker``: ``TransferWorker``, the thin owner of one rank's thread and NIXL agent;
- ``reads/``: a decode's reads, one ``ReadPath`` class per way of moving bytes;
- ``routes``: the path each prefill rank is read over, chosen per peer;
- ``peers``, ``handshakes``: handshaken prefill peers; handshakes on pool threads;
- ``pushes/``: push mode, a prefill rank's WRITEs into decode reservations;
- ``leases``: the prefill's lease table and its side-channel answers;
- ``lease_client``: a decode's claims, renewals and releases;
- ``liveness``: since when each prefill side channel read from has been silent;
- ``lanes``, ``threads``: read lanes; work split over copy threads;
- ``local_rank``, ``results``: one decode rank as a reader; what a worker reports;
- ``nixl_agent``: one NIXL agent per rank (the only module that imports NIXL);
- ``side_channel/``: the ZMQ side channel (the only package that imports ZMQ);
- ``converted/``: staging, host and mapped reads, reads shared by sibling ranks;
- ``faults``: messages lost on purpose, for fault tests.

Design: docs/design/transfer-worker.md
"""
