"""Failures that cross layers: the engine's workers raise them, the loop and the servers read them."""
from __future__ import annotations

import enum


class FailureKind(enum.Enum):
    """Why a request ended without finishing, for ``on_error``."""

    REQUEST = "request"  # the engine ended this request alone because it faulted
    INVALID = "invalid"  # the engine ended this request alone because its input cannot be served
    ENGINE = "engine"  # a step failed and the fault could not be pinned on one request
    UNAVAILABLE = "unavailable"  # the loop stopped or died
    TIMEOUT = "timeout"  # the request's sampling_parameters.timeout passed


class EngineUnavailable(RuntimeError):
    """The loop is not serving (stopped or dead); the message says why."""


class EngineBroken(RuntimeError):
    """The engine can never step again (a tensor-parallel worker died): the loop must die with it, so that
    the serving layer replaces the engine instead of failing every later step."""
