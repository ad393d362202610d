"""Errors of the export package; the CLI prints them as one line and exits 2."""

from model.errors import PosencError


class ExportError(PosencError):
    """An export could not be done (bad input, existing output, unsupported option)."""


class ArtifactError(ExportError):
    """An artifact folder is incomplete, or a file does not match its manifest."""
