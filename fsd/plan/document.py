"""Control-file JSON -> validated :class:`Plan`.

The training job writes its seed and epoch plan into ``MOUNT/.fsd/control``.
:func:`parse_plan` accepts only a flat JSON object with the keys below and
raises :class:`PlanError` (and nothing else, for any input) with a message
meant for users: it is shown verbatim in ``.fsd/error``.

Keys (default in parentheses, "required" when there is none):

- ``seed`` int (0); ``epochs`` int >= 1 (required); ``start_epoch`` int, 0 <= start_epoch < epochs (0):
  epochs ``start_epoch .. epochs-1`` are still to come.
- ``sampler``: ``distributed`` | ``random`` | ``sequential`` | ``indices`` (required).
- distributed only: ``num_replicas`` int >= 1 (required), ``ranks`` list of distinct ints in
  ``[0, num_replicas)``, the ranks running on this node (required), ``shuffle`` bool (true),
  ``drop_last`` bool (false).
- indices only: ``indices_file`` relative path (required): a ``.npy`` 2-D int array or a JSON
  list of lists, row ``e`` = the node's sample indices of epoch ``e`` (absolute epoch number).
- ``order``: ``imagefolder`` | ``sorted`` | ``list`` (``imagefolder``); ``list_file`` relative path,
  required iff ``order`` is ``list``.
- ``batch_size`` int >= 1 (1), ``num_workers`` int >= 0 (0), ``prefetch_factor`` int >= 1 (2):
  they size the reorder window of DataLoader workers.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)
_T = TypeVar("_T")

MAX_PLAN_BYTES = 1 << 20
"""Control writes larger than this are refused before parsing."""

SAMPLERS = ("distributed", "random", "sequential", "indices")
ORDERS = ("imagefolder", "sorted", "list")

# torch.Generator.manual_seed accepts [-2**63, 2**64 - 1]; DistributedSampler seeds seed + epoch.
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 64) - 1

# Upper bounds keep a plan buildable (and a typo like 1e9 epochs from eating the node's RAM).
MAX_EPOCHS = 100_000
MAX_REPLICAS = 1 << 20
MAX_BATCH_SIZE = 1 << 24
MAX_WORKERS = 4096
MAX_PREFETCH = 4096
MAX_PATH_CHARS = 4096

_COMMON_KEYS = ("seed", "epochs", "start_epoch", "sampler", "order", "list_file",
                "batch_size", "num_workers", "prefetch_factor")
_DISTRIBUTED_KEYS = ("num_replicas", "ranks", "shuffle", "drop_last")
_INDICES_KEYS = ("indices_file",)
VALID_KEYS: tuple[str, ...] = _COMMON_KEYS + _DISTRIBUTED_KEYS + _INDICES_KEYS


class PlanError(ValueError):
    """The control file does not hold a valid plan; the message says why."""


@dataclass(frozen=True)
class Plan:
    """A validated epoch plan. Fields not used by ``sampler`` hold their neutral values."""

    epochs: int
    sampler: str
    seed: int = 0
    start_epoch: int = 0
    num_replicas: int = 1
    ranks: tuple[int, ...] = (0,)
    shuffle: bool = True
    drop_last: bool = False
    indices_file: str | None = None
    order: str = "imagefolder"
    list_file: str | None = None
    batch_size: int = 1
    num_workers: int = 0
    prefetch_factor: int = 2

    @property
    def remaining_epochs(self) -> range:
        """The absolute epoch numbers still to come."""
        return range(self.start_epoch, self.epochs)

    def to_dict(self) -> dict[str, Any]:
        """The plan as the JSON object :func:`parse_plan` accepts (every applicable key explicit)."""
        d: dict[str, Any] = {"seed": self.seed, "epochs": self.epochs, "start_epoch": self.start_epoch,
                             "sampler": self.sampler}
        if self.sampler == "distributed":
            d.update(num_replicas=self.num_replicas, ranks=list(self.ranks), shuffle=self.shuffle,
                     drop_last=self.drop_last)
        elif self.sampler == "indices":
            d["indices_file"] = self.indices_file
        d["order"] = self.order
        if self.order == "list":
            d["list_file"] = self.list_file
        d.update(batch_size=self.batch_size, num_workers=self.num_workers,
                 prefetch_factor=self.prefetch_factor)
        return d

    def to_json(self) -> str:
        """Canonical JSON text of the plan (for ``.fsd/status``); parses back to an equal plan."""
        return json.dumps(self.to_dict(), sort_keys=False)


def _describe(v: Any) -> str:
    """Short user-facing rendering of a JSON value with its JSON type."""
    if isinstance(v, bool):
        return f"{str(v).lower()} (a boolean)"
    if v is None:
        return "null"
    if isinstance(v, int):
        s = str(v)
        return (s if len(s) <= 40 else s[:20] + "..." + s[-10:]) + " (an integer)"
    if isinstance(v, float):
        return f"{v!r} (a number with a fraction or exponent)"
    if isinstance(v, str):
        r = json.dumps(v)
        return (r if len(r) <= 60 else r[:57] + '..."') + " (a string)"
    if isinstance(v, list):
        return f"a list of {len(v)} item(s)"
    if isinstance(v, dict):
        return f"an object with {len(v)} key(s)"
    return type(v).__name__  # pragma: no cover - json yields only the types above


def _int(d: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int:
    """Fetch an integer key (bool refused) within ``[lo, hi]``."""
    if key not in d:
        if default is None:
            raise PlanError(f"plan: '{key}' is required (an integer >= {lo})")
        return default
    v = d[key]
    if type(v) is not int:
        raise PlanError(f"plan: '{key}' must be an integer, got {_describe(v)}")
    if not lo <= v <= hi:
        raise PlanError(f"plan: '{key}' must be between {lo} and {hi}, got {_describe(v)}")
    return v


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if type(v) is not bool:
        raise PlanError(f"plan: '{key}' must be true or false, got {_describe(v)}")
    return v


def _choice(d: dict[str, Any], key: str, default: str | None, choices: tuple[str, ...]) -> str:
    alts = ", ".join(f'"{c}"' for c in choices)
    if key not in d:
        if default is None:
            raise PlanError(f"plan: '{key}' is required, one of {alts}")
        return default
    v = d[key]
    if not isinstance(v, str) or v not in choices:
        hint = ""
        if isinstance(v, str):
            close = difflib.get_close_matches(v, choices, n=1)
            hint = f' (did you mean "{close[0]}"?)' if close else ""
        raise PlanError(f"plan: '{key}' must be one of {alts}, got {_describe(v)}{hint}")
    return v


def check_relative_path(key: str, v: Any) -> str:
    """Validate a dataset-relative path: non-empty, relative, no ``..``, no NUL. Returns it normalised."""
    if not isinstance(v, str):
        raise PlanError(f"plan: '{key}' must be a path string relative to the dataset root, got {_describe(v)}")
    if not v or len(v) > MAX_PATH_CHARS:
        raise PlanError(f"plan: '{key}' must be a non-empty path of at most {MAX_PATH_CHARS} characters")
    if "\x00" in v:
        raise PlanError(f"plan: '{key}' must not contain a NUL character")
    if v.startswith("/"):
        raise PlanError(f"plan: '{key}' must be relative to the dataset root, got the absolute path {_describe(v)}")
    parts = [p for p in v.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PlanError(f"plan: '{key}' must stay inside the dataset root ('..' is not allowed), got {_describe(v)}")
    if not parts:
        raise PlanError(f"plan: '{key}' must name a file, got {_describe(v)}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise PlanError(f"plan: '{key}' is not valid UTF-8 text") from None
    return "/".join(parts)


def order_of(d: dict[str, Any], kw: dict[str, Any], root: str) -> str:
    """The plan's ``order``; for ``list`` its ``list_file`` (relative to *root*) goes into *kw*."""
    order = _choice(d, "order", "imagefolder", ORDERS)
    if order == "list":
        if "list_file" not in d:
            raise PlanError("plan: 'list_file' is required when 'order' is \"list\" "
                            f"(a file of paths relative to the {root}, one per line)")
        kw["list_file"] = check_relative_path("list_file", d["list_file"])
    elif "list_file" in d:
        raise PlanError(f"plan: 'list_file' applies only to order \"list\", not \"{order}\"")
    return order


def _no_dupes(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise PlanError(f"plan: key {json.dumps(k[:60])} appears more than once")
        d[k] = v
    return d


def _no_constant(name: str) -> Any:
    raise PlanError(f"plan: {name} is not allowed (not valid JSON)")


def _decode(data: bytes) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PlanError(f"plan: expected bytes, got {type(data).__name__}")
    if len(data) > MAX_PLAN_BYTES:
        raise PlanError(f"plan: control write of {len(data)} bytes is larger than the {MAX_PLAN_BYTES} byte limit")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"plan: not UTF-8 text (bad byte at offset {e.start})") from None
    if not text.strip():
        raise PlanError("plan: empty; expected a JSON object such as "
                        '{"epochs": 90, "sampler": "distributed", "num_replicas": 8, "ranks": [0]}')
    try:
        return json.loads(text, object_pairs_hook=_no_dupes, parse_constant=_no_constant)
    except PlanError:
        raise
    except json.JSONDecodeError as e:
        raise PlanError(f"plan: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise PlanError("plan: JSON nested too deeply (the plan is a flat object)") from None
    except ValueError:  # an integer literal longer than Python's int-conversion limit (4300 digits)
        raise PlanError("plan: invalid JSON: a number has too many digits") from None


def _key_owner(key: str) -> str | None:
    if key in _DISTRIBUTED_KEYS:
        return "distributed"
    if key in _INDICES_KEYS:
        return "indices"
    return None


def _parse(data: bytes) -> Plan:
    d = _decode(data)
    if not isinstance(d, dict):
        raise PlanError(f"plan: the control file must hold a JSON object, got {_describe(d)}")
    for key in d:
        if key not in VALID_KEYS:
            close = difflib.get_close_matches(key, VALID_KEYS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            shown = json.dumps(key if len(key) <= 60 else key[:57] + "...")[1:-1]  # ASCII-safe
            raise PlanError(f"plan: unknown key '{shown}'{hint}; valid keys: {', '.join(VALID_KEYS)}")
    sampler = _choice(d, "sampler", None, SAMPLERS)
    for key in d:
        owner = _key_owner(key)
        if owner is not None and owner != sampler:
            raise PlanError(f"plan: '{key}' applies only to sampler \"{owner}\", not \"{sampler}\"")

    epochs = _int(d, "epochs", None, 1, MAX_EPOCHS)
    start_epoch = _int(d, "start_epoch", 0, 0, MAX_EPOCHS)
    if start_epoch >= epochs:
        raise PlanError(f"plan: 'start_epoch' ({start_epoch}) must be less than 'epochs' ({epochs}): "
                        "epochs start_epoch .. epochs-1 are the ones still to come")
    seed = _int(d, "seed", 0, SEED_MIN, SEED_MAX)
    kw: dict[str, Any] = {}
    if sampler == "distributed":
        if seed + epochs - 1 > SEED_MAX:
            raise PlanError(f"plan: 'seed' + epoch must stay <= {SEED_MAX} (torch.Generator.manual_seed range); "
                            f"seed {seed} with {epochs} epochs overflows")
        num_replicas = _int(d, "num_replicas", None, 1, MAX_REPLICAS)
        if "ranks" not in d:
            raise PlanError("plan: 'ranks' is required for sampler \"distributed\": "
                            "the list of ranks running on this node, e.g. [0, 1, 2, 3]")
        ranks = d["ranks"]
        if not isinstance(ranks, list) or not ranks:
            raise PlanError(f"plan: 'ranks' must be a non-empty list of integers, got {_describe(ranks)}")
        for r in ranks:
            if type(r) is not int:
                raise PlanError(f"plan: 'ranks' must hold integers only, found {_describe(r)}")
            if not 0 <= r < num_replicas:
                raise PlanError(f"plan: rank {_describe(r)} is outside [0, {num_replicas}) "
                                f"(num_replicas is {num_replicas})")
        seen: set[int] = set()
        for r in ranks:
            if r in seen:
                raise PlanError(f"plan: 'ranks' lists rank {r} more than once")
            seen.add(r)
        kw.update(num_replicas=num_replicas, ranks=tuple(ranks), shuffle=_bool(d, "shuffle", True),
                  drop_last=_bool(d, "drop_last", False))
    elif sampler == "indices":
        if "indices_file" not in d:
            raise PlanError("plan: 'indices_file' is required for sampler \"indices\" "
                            "(a .npy or .json file relative to the dataset root)")
        kw["indices_file"] = check_relative_path("indices_file", d["indices_file"])
    order = order_of(d, kw, "dataset root")
    return Plan(
        epochs=epochs, sampler=sampler, seed=seed, start_epoch=start_epoch, order=order,
        batch_size=_int(d, "batch_size", 1, 1, MAX_BATCH_SIZE),
        num_workers=_int(d, "num_workers", 0, 0, MAX_WORKERS),
        prefetch_factor=_int(d, "prefetch_factor", 2, 1, MAX_PREFETCH),
        **kw,
    )


def only_plan_errors(parse: Callable[[], _T], what: str) -> _T:
    """``parse()``, whose every failure becomes a :class:`PlanError` (defence in depth: a control
    write gets a clear error, never a crash of the mount), *what* naming the document in the log."""
    try:
        return parse()
    except PlanError:
        raise
    except (RecursionError, MemoryError):
        raise PlanError("plan: JSON too large or nested too deeply") from None
    except Exception as e:
        log.exception("unexpected error while parsing %s", what)
        raise PlanError(f"plan: could not be parsed ({type(e).__name__})") from None


def parse_plan(data: bytes) -> Plan:
    """Parse and validate a control-file write. Raises only :class:`PlanError`."""
    plan = only_plan_errors(lambda: _parse(data), "a plan")
    log.debug("parsed plan %s", plan)
    return plan


def window_entries(plan: Plan) -> int:
    """Reorder slack of DataLoader workers, in stream entries (see ``access_stream``)."""
    return len(plan.ranks) * plan.batch_size * max(1, plan.num_workers) * plan.prefetch_factor


__all__ = ["MAX_PLAN_BYTES", "ORDERS", "SAMPLERS", "VALID_KEYS", "Plan", "PlanError",
           "check_relative_path", "parse_plan", "window_entries"]
