"""The ``kvxfer`` command line's sub-commands, loaded lazily by ``kvxfer.cli``. Modules:

- ``serve``: run a prefill, decode or plain sidecar;
- ``generate``: the reference engine offline on prompts;
- ``models``: the names ``--model`` accepts and what each resolves to;
- ``plan``: what a prefill/decode configuration will cost per request;
- ``accuracy``: whether a deployment answers exactly like a reference instance;
- ``demo``: a prefill, a decode and the proxy, end to end;
- ``bench``: ``kvxfer bench <what>``, dispatching to :mod:`kvxfer.bench`.
"""
