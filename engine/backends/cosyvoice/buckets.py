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


def row_buckets(max_rows: int, step: int = 32, dense_below: int = 64) -> list[int]:
    """Powers of two up to `dense_below`, then multiples of `step`, then `max_rows` (the last).

    Above 64 rows a power of two pads a 130-row batch to 256 (twice the work);
    multiples of 32 pad it to 160, for a few more graphs captured at load.
    """
    if max_rows < 1:
        raise ValueError(f"expected max_rows >= 1, got {max_rows}")
    out, b = [], 1
    while b <= dense_below and b < max_rows:
        out.append(b)
        b *= 2
    b = dense_below + step
    while b < max_rows:
        out.append(b)
        b += step
    return out + [max_rows]
