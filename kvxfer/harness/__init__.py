"""Test and benchmark harnesses: instances and networks to run kvxfer against. Modules:

- ``loopback``: model-free prefill and decode instances on loopback (``PrefillProcess``);
- ``netns``: two network namespaces joined by a veth pair (root only);
- ``network``: hosts in network namespaces joined by a bridge (root only);
- ``synthetic``: address-only KV caches of a model shape, for ``kvxfer plan``.
"""
