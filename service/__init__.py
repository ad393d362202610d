"""posenc worker: serves ONNX artifacts with onnxruntime over gRPC.  Never imports torch or export."""
