"""Reads that are not plain NIXL READs into place: staged, copied on one host, shared by the
decode ranks of one process. Modules:

- ``staging_pool``: registered staging buffers and the converter thread;
- ``shared_staging``: sibling ranks sharing a staged read of one prefill rank;
- ``siblings``: where sibling ranks meet to share one read;
- ``process_shares``: what the decode ranks of one process share;
- ``host_reads``: ``process_vm_readv`` reads on one host, converted by the copy;
- ``mapped_reads``: reads from a prefill's cache mapped into the decode;
- ``fd_handover``: handing a cache buffer's descriptor to a reader that proves its rights;
- ``stream_copy``: copies with streaming stores (the compiled ``_stream_copy.c``).

Design: docs/design/converted-reads.md, docs/design/host-reads.md
"""
