"""The serving runtime: continuous batching over one model's context (``Engine``), its admission, the slots kept
as a cache of token prefixes with a host tier below them, and the request streams the fronts read.

It sits above ``state`` and ``accounting`` (the host tier's memory comes from :mod:`kvrt.state.hostpool`) and below
the fronts in ``serve``; the engine layer under it knows nothing of requests.
"""
