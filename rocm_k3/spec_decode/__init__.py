"""Speculative decoding: proposers (n-gram prompt lookup), the acceptance rules (greedy and rejection sampling),
the speculative config and its counters. The scheduler drafts and plans per-position KDA state slots; the
worker verifies every draft in one target forward and returns the accepted tokens."""
