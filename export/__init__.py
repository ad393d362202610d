"""Checkpoint -> ONNX artifact (DESIGN.md section 4), parity validation, manifests, Triton repository writer."""
