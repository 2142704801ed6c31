"""Shape buckets shared by the captured paths: LM decode batches (lm/graphs.py) and flow
estimator rows and frames (flow_runtime/estimator_graphs.py).

A captured CUDA graph has fixed shapes, so a call is padded up to the smallest
bucket that holds it; every bucket is one graph and its warm-up memory.
"""

from __future__ import annotations


def bucket_of(n: int, buckets: list[int]) -> int:
    """The smallest bucket >= n (buckets ascending)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"expected at most {buckets[-1]}, got {n}")
