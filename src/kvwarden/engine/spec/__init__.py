"""Speculative decoding: proposers (n-gram, draft model, MTP head), verification, and the speculator that
runs them around an engine step. The engine depends on this package, never the other way round: proposers
see the target through :class:`~kvwarden.engine.spec.target.SpecTarget` and build a draft model's engine
through a factory the engine hands in."""
