"""Errors raised by dlinfer ops and vendor selection."""


class InvalidArgumentError(ValueError):
    """An op argument has the wrong rank, size, dtype, device or value.

    The message names the op, the argument, what was expected and what came.
    """

    def __init__(self, op: str, arg: str, expected: str, got: str):
        self.op, self.arg, self.expected, self.got = op, arg, expected, got
        super().__init__(f"dlinfer.ops.{op}: argument '{arg}': expected {expected}, got {got}")


class UnsupportedError(NotImplementedError):
    """The active vendor does not implement a feature an op was asked for."""

    def __init__(self, vendor: str, op: str, feature: str):
        self.vendor, self.op, self.feature = vendor, op, feature
        super().__init__(f"dlinfer vendor '{vendor}' does not support {feature} in op '{op}'")


class VendorError(RuntimeError):
    """A vendor asked for by name cannot be loaded or used."""
