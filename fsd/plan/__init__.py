"""The job's plan: the control document, bit-exact samplers, sample orders, access streams and the
next-use/frequency math. Pure computation: nothing here does I/O on a mount."""

from fsd.plan.document import (
                               MAX_PLAN_BYTES,
                               VALID_KEYS,
                               Plan,
                               PlanError,
                               check_relative_path,
                               parse_plan,
                               window_entries,
)

__all__ = ["MAX_PLAN_BYTES", "VALID_KEYS", "Plan", "PlanError", "check_relative_path", "parse_plan", "window_entries"]
