"""The flow estimator at run time: CUDA graphs, ONNX export and onnxruntime, TensorRT, and the one
place that chooses among them (choose.py)."""
