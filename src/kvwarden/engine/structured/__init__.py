"""Structured outputs: what a request's text must match, and the per-request grammar state that masks its logits."""
