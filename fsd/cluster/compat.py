"""The only place the cluster package imports the rest of fsd.

Keeping every such import here means a move of a core module touches one file.
"""

from __future__ import annotations

from fsd.sizes import parse_size as _parse_size
from fsd.errors import FsdError
from fsd.plan.document import PlanError
from fsd.plan.job import JobPlan
from fsd.plan.job_stream import Built, JobListing, job_demand
from fsd.threads import start_thread


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


__all__ = ["Built", "FsdError", "JobListing", "JobPlan", "PlanError", "job_demand", "parse_size", "start_thread"]
