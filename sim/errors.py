"""The project's own exceptions: user mistakes, with a message that names the file and field."""


class KvsimError(Exception):
    """Base: anything the CLI reports as bad input (exit 2) without a traceback."""


class ScenarioError(KvsimError):
    """A scenario file is unreadable or invalid."""


class TraceError(KvsimError):
    """A trace directory is missing, partial, of another format version or corrupt."""


class ProfileError(KvsimError):
    """An unknown profile, fault or switch."""
