"""Disaggregated prefill/decode: the roles (prefill and decode services), their control protocol and its
HTTP routes, and the NIXL transfer agent that writes KV between instances. It sits above the server's
HTTP front end (the decode role is the async engine's remote-KV hooks) and the engine (whose remote-KV
verbs, :mod:`kvwarden.engine.remote_kv`, keep a request's blocks until a transfer allows)."""
