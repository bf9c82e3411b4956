"""One place that maps domain errors to errno for FUSE replies.

pyfuse3 is imported by the functions that need it, not by this module: the CLI's error type
lives here, and ``fsd status`` must not load the FUSE library (:mod:`fsd.status`)."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Coroutine
from functools import wraps
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class FsdError(Exception):
    """A user-facing error: one line, no traceback, exit code 1 in the CLI."""


class ControlError(ValueError):
    """A control-file write was refused; the message goes to ``.fsd/error``."""


def to_errno(exc: BaseException) -> int:
    """The errno a FUSE reply should carry for *exc*."""
    import pyfuse3

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
    import pyfuse3

    fuse_error = pyfuse3.FUSEError

    @wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except fuse_error:
            raise
        except OSError as e:
            raise fuse_error(to_errno(e)) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise fuse_error(errno.EIO) from None

    return wrapper
