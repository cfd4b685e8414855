"""Typed errors a user can cause. Every message says what to do about it."""

from __future__ import annotations


class MiniSGLError(Exception):
    """Base class of every error minisgl raises on purpose."""


class InvalidRequestError(MiniSGLError, ValueError):
    """A request (prompt or sampling parameters) that cannot be served as given."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit the model's context window."""


class GrammarError(InvalidRequestError):
    """An invalid JSON schema, regex or EBNF grammar, or conflicting constraints."""


class ConfigError(MiniSGLError, ValueError):
    """An engine option with an invalid value (unknown cache kind, page_size < 1, ...)."""


class ModelLoadError(MiniSGLError):
    """The model could not be found or loaded."""


class UnknownModelError(ModelLoadError, FileNotFoundError):
    """The model path, alias or hub id does not resolve to a model."""


class UnknownArchitectureError(ModelLoadError):
    """config.json names an architecture no registered model implements."""


class WeightsError(ModelLoadError):
    """Weights are missing, truncated or do not match the architecture."""


class OutOfMemoryError(MiniSGLError, MemoryError):
    """The KV pool cannot hold even a single request of this size."""


class EngineError(MiniSGLError, RuntimeError):
    """A forward pass failed: at start-up (a dtype or kernel this machine cannot run), or for one batch,
    whose requests fail with this error while the engine keeps serving the others."""


class DaemonError(MiniSGLError):
    """Base class for errors talking to the minisgl daemon."""


class DaemonNotRunningError(DaemonError, ConnectionError):
    """No daemon answers at the address (and auto-start was off or failed)."""


class DaemonTimeoutError(DaemonError, TimeoutError):
    """The daemon did not answer within the client's timeout."""


class RequestAbortedError(MiniSGLError):
    """The request was aborted (by the user, a shutdown or a failure) before it finished."""
