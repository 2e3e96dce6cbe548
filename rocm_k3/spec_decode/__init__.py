"""Speculative decoding: proposers (n-gram prompt lookup in the scheduler; the hidden-state drafter of
``draft_model`` on the worker, whose drafts travel back with the sampled tokens), the acceptance rules (greedy and
rejection sampling), the speculative config and its counters. The scheduler plans per-position KDA state slots;
the worker verifies every draft in one target forward and returns the accepted tokens."""
