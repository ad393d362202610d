"""One error hierarchy for the model package; CLIs turn these into one-line messages and exit 2."""


class PosencError(Exception):
    """Base class for every error posenc raises on purpose."""


class ConfigError(PosencError, ValueError):
    """A configuration is inconsistent or names something unknown."""


class UnknownVariantError(ConfigError):
    def __init__(self, name: str, known: list[str]):
        self.name, self.known = name, list(known)
        super().__init__(f"unknown variant {name!r}; known variants: {', '.join(self.known)}")


class SequenceTooLongError(PosencError, ValueError):
    """Input longer than a variant with a bounded position table allows."""

    def __init__(self, length: int, limit: int, variant: str):
        self.length, self.limit, self.variant = length, limit, variant
        super().__init__(
            f"sequence of {length} positions exceeds the {variant} variant's limit of {limit} positions "
            f"(max_positions={limit})"
        )


class CorpusError(PosencError):
    """A training corpus is missing, empty, unreadable or not UTF-8."""


class CheckpointError(PosencError):
    """A checkpoint folder is missing files, has corrupted ones, or cannot be written."""


class ImportRefusedError(PosencError):
    """A Hugging Face folder cannot be imported exactly: a missing or damaged file, or a model posenc does not
    implement (the message names the file or field and what is supported).  Never a silently different model."""
