"""Checkpoint -> ONNX artifact (ARCHITECTURE.md section 4), parity validation, manifests, Triton repository writer."""
