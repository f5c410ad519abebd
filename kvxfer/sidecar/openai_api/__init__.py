"""The OpenAI-compatible surface of a sidecar: request types, validation, answers.

Pure except for the tokenizer: no I/O, no engine. Modules, one concept each:

- ``request_bodies``: the two routes' bodies, decoded strictly (``decode_body``);
- ``validation``: a body into a ``Prepared`` request, every 400/404 before allocation;
- ``prepared``: ``Prepared`` and what validation knows of the instance (``ModelInfo``);
- ``kv_params``: what ``kv_transfer_params`` ask of this role; ``unread_lease``;
- ``answers``: choices, logprobs, bodies, stream chunks and server-sent events;
- ``error_body``: ``OpenAIError`` and its JSON body.

Design: docs/design/openai-api.md
"""
