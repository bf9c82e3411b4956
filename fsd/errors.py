"""One place that maps domain errors to errno for FUSE replies."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Coroutine
from functools import wraps
from typing import Any, TypeVar

import pyfuse3

log = logging.getLogger(__name__)

T = TypeVar("T")


class FsdError(Exception):
    """A user-facing error: one line, no traceback, exit code 1 in the CLI."""


class ControlError(ValueError):
    """A control-file write was refused; the message goes to ``.fsd/error``."""


def to_errno(exc: BaseException) -> int:
    """The errno a FUSE reply should carry for *exc*."""
    if isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    if isinstance(exc, (ValueError, ControlError)):
        return errno.EINVAL
    if isinstance(exc, MemoryError):
        return errno.ENOMEM
    return errno.EIO


def fuse_errors(fn: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., Coroutine[Any, Any, T]]:
    """Decorate an async FUSE handler so that only ``FUSEError`` leaves it.

    ``OSError`` keeps its errno; anything unexpected is logged with its
    traceback and answered with EIO, so a bug never tears down the session.
    """

    @wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            raise pyfuse3.FUSEError(to_errno(e)) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper
