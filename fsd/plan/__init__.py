"""The job's plan: the control document (one loader, or a whole job of several), bit-exact samplers,
sample orders, access streams and the next-use/frequency math; and the helpers a training job calls
(``from_loaders``, ``write``). Importing this package imports neither torch nor pyfuse3; nothing here
does I/O on a mount except :func:`write`."""

from fsd.plan.document import (
                               MAX_PLAN_BYTES,
                               VALID_KEYS,
                               Plan,
                               PlanError,
                               check_relative_path,
                               parse_plan,
                               window_entries,
)
from fsd.plan.job import JobPlan, Loader, parse_job
from fsd.plan.live import PlanRefused, UnpredictableLoader, from_loaders, write

__all__ = ["MAX_PLAN_BYTES", "VALID_KEYS", "JobPlan", "Loader", "Plan", "PlanError", "PlanRefused",
           "UnpredictableLoader", "check_relative_path", "from_loaders", "parse_job", "parse_plan", "window_entries",
           "write"]
