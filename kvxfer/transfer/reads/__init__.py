"""A decode rank's reads: one :class:`~kvxfer.transfer.reads.read.Read` per request,
moved by the paths its peer's plans call for (direct, lanes, staged, host, mapped: one
:class:`~kvxfer.transfer.reads.path.ReadPath` interface), driven by the
:class:`~kvxfer.transfer.reads.reader.Reader` on the worker's thread."""
