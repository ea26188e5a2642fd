"""The two families of errors: the user's mistakes and our bugs."""

from __future__ import annotations


class ScheduleError(ValueError):
    """A mistake in a definition or a schedule: names the tensor and axis, says what to do."""


class NoGPUError(RuntimeError):
    """Something that runs on a CUDA GPU was asked for on a machine without one; says what
    runs on the CPU instead, where something does."""


class InternalError(RuntimeError):
    """A broken internal invariant. Never the user's fault."""

    def __init__(self, message: str) -> None:
        super().__init__(
            f"internal error (this is a bug in codegen, please report it): {message}"
        )
