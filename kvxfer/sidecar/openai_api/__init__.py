"""The OpenAI-compatible surface of a sidecar: request types, validation, answers.

Pure except for the tokenizer: no I/O, no engine. The server decodes a body with
:func:`~.request_bodies.decode_body` into :class:`~.request_bodies.CompletionRequest` /
:class:`~.request_bodies.ChatRequest` (msgspec, strict types), turns it into a
:class:`~.prepared.Prepared` request with :func:`~.validation.prepare_completion` /
:func:`~.validation.prepare_chat` (every check that can answer 400 happens there, before
anything is allocated; the ``kv_transfer_params`` in :mod:`.kv_params`), and formats
engine outputs with :class:`~.answers.Choice` and the ``*_body`` / ``*_chunk`` functions
of :mod:`.answers`.

Errors are :class:`~.errors.OpenAIError`; their body is ``{"error": {"message", "type",
"param", "code"}}`` with ``code`` the HTTP status, as the proxy answers too.

``kv_transfer_params`` (vLLM's keys):

* prefill (or both) role, ``do_remote_decode: true``: the prompt is computed and its
  blocks leased (``Prepared.kind`` a ``LeaseOut``; a ``PushOut`` when the params bring a
  decode's reservation); the answer carries the params a decode reads with. Streaming
  such a request is refused.
* decode (or both) role, ``do_remote_prefill: true``: the prompt's KV is read from the
  prefill named in the params (a ``PullIn``; a ``PushIn`` when they name a reservation of
  this decode), which must describe exactly
  this prompt (``remote_num_tokens``, one block id per ``remote_block_size``
  tokens: the prefill's block size, this decode's when absent).
* anything else: a plain request (the params are ignored).

Both transfer paths take exactly one prompt. A prefill request takes ``n`` 1 (the
prompt is computed once whatever the client asked for); a decode request may ask
for ``n`` samples, which share one KV read. A decode request refused here
(any 400/404) still names a prefill lease that nobody will read;
:func:`~.kv_params.unread_lease` finds it in the raw body, so that the server can release
it at once instead of leaving it to the lease TTL.
"""
