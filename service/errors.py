"""The worker's error hierarchy, one class per row of the error contract (ARCHITECTURE.md section 6), mapped to
gRPC status codes."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    param: str | None = None  # the request field at fault, where one is (HTTP answers name it)


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class TooLarge(ResourceExhausted):
    """The answer would pass the message size limit: asking again will not help, asking for less will (HTTP 413;
    a busy queue or too many streams stay plain ResourceExhausted, HTTP 429)."""


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class FailedPrecondition(ServiceError):
    """The request is fine but the artifact cannot answer it (exported before the feature existed)."""
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class ArtifactRejected(Exception):
    """An artifact folder that cannot be served (logged with its reason; the others are served)."""
