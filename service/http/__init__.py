"""The worker's HTTP front (KServe v2 REST, OpenAI-compatible completions, posenc JSON, the attention viewer):
a thin translation to service.operations, beside gRPC in the same process (service.http.app)."""
