"""The only place the cluster package imports the rest of fsd.

Keeping every such import here means a move of a core module touches one file. The plan's access
streams (``fsd.plan.job_stream``: torch's samplers) are imported on first use, so that the
checkpoint daemon, which uses only the transport, does not pay for torch at its start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fsd.errors import FsdError
from fsd.plan.document import PlanError
from fsd.plan.job import JobPlan
from fsd.sizes import parse_size as _parse_size
from fsd.threads import name_os_thread, start_thread

if TYPE_CHECKING:
    from fsd.plan.job_stream import Built, JobListing, first_use_order, job_demand

_ON_FIRST_USE = {"Built": "fsd.plan.job_stream", "JobListing": "fsd.plan.job_stream",
                 "job_demand": "fsd.plan.job_stream", "first_use_order": "fsd.plan.job_stream"}


def __getattr__(name: str) -> Any:
    if name in _ON_FIRST_USE:
        return getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_size(text: str | int) -> int:
    """``'16G'``, ``'512M'``, ``4096`` -> bytes; ValueError on anything else."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"not a size: {text!r}")
        return text
    try:
        return _parse_size(str(text))
    except Exception:  # argparse.ArgumentTypeError
        raise ValueError(f"not a size: {text!r} (use e.g. 512M, 16G)") from None


__all__ = ["Built", "FsdError", "JobListing", "JobPlan", "PlanError", "first_use_order", "job_demand",
           "name_os_thread", "parse_size", "start_thread"]
