"""Shared settings of the sharding tests and their subprocesses (the tiny model's greedy run)."""

# Three sequences of different lengths in one step: prefill of all three, then decodes.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [42, 42, 42, 42, 42]]
MAX_NEW = 6
# One 16-token bucket for prefill and decode: every run compiles the step once.
GEN = dict(page_size=16, bucket_tokens=16, pages_per_seq=2)
# 8 pages / 8 slots split evenly over data*expert (<= 8); page/slot 0 stays the sink.
POOL = dict(num_pages=8, page_size=16, num_slots=8)
