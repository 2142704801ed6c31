"""The speech LM at run time: the slot-cache runner, its CUDA-graph decoder, sampling, and the
drivers the backend talks to (torch, or vLLM)."""
