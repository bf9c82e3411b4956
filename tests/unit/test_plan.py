"""fsd.plan: control-file parsing, strict validation, fuzzing (issue 5)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsd.plan.document
from fsd.plan.document import MAX_PLAN_BYTES, VALID_KEYS, Plan, PlanError, parse_plan, window_entries

BASE: dict[str, Any] = {"seed": 7, "epochs": 90, "sampler": "distributed", "num_replicas": 16, "ranks": [0, 1, 2, 3],
                        "batch_size": 256, "num_workers": 8}


def _p(d: Any) -> Plan:
    return parse_plan(json.dumps(d).encode())


def _err(d: Any) -> str:
    with pytest.raises(PlanError) as ei:
        parse_plan(d if isinstance(d, bytes) else json.dumps(d).encode())
    return str(ei.value)


def test_valid_distributed_plan_with_defaults() -> None:
    p = _p(BASE)
    assert p == Plan(epochs=90, sampler="distributed", seed=7, num_replicas=16, ranks=(0, 1, 2, 3),
                     batch_size=256, num_workers=8)
    assert (p.start_epoch, p.shuffle, p.drop_last, p.order, p.prefetch_factor) == (0, True, False, "imagefolder", 2)
    assert list(p.remaining_epochs) == list(range(90))
    assert window_entries(p) == 4 * 256 * 8 * 2


def test_minimal_other_samplers() -> None:
    assert _p({"epochs": 1, "sampler": "random"}) == Plan(epochs=1, sampler="random")
    assert _p({"epochs": 2, "sampler": "sequential", "start_epoch": 1}).remaining_epochs == range(1, 2)
    p = _p({"epochs": 3, "sampler": "indices", "indices_file": "./lists//ix.npy", "order": "list",
            "list_file": "files.txt"})
    assert (p.indices_file, p.list_file, p.order) == ("lists/ix.npy", "files.txt", "list")
    assert window_entries(_p({"epochs": 1, "sampler": "random"})) == 2


@pytest.mark.parametrize("doc,needle", [
    ({**BASE, "epoch": 3}, "unknown key 'epoch' (did you mean 'epochs'?)"),
    ({**BASE, "num_replica": 3}, "did you mean 'num_replicas'?"),
    ({**BASE, "zzzzqqq": 3}, "unknown key 'zzzzqqq'; valid keys"),
    ({k: v for k, v in BASE.items() if k != "epochs"}, "'epochs' is required"),
    ({k: v for k, v in BASE.items() if k != "sampler"}, "'sampler' is required"),
    ({k: v for k, v in BASE.items() if k != "ranks"}, "'ranks' is required"),
    ({k: v for k, v in BASE.items() if k != "num_replicas"}, "'num_replicas' is required"),
    ({**BASE, "epochs": True}, "'epochs' must be an integer, got true (a boolean)"),
    ({**BASE, "epochs": 0}, "'epochs' must be between 1"),
    ({**BASE, "epochs": 2.0}, "'epochs' must be an integer"),
    ({**BASE, "epochs": "90"}, "'epochs' must be an integer, got \"90\" (a string)"),
    ({**BASE, "epochs": 10**30}, "'epochs' must be between"),
    ({**BASE, "start_epoch": 90}, "'start_epoch' (90) must be less than 'epochs' (90)"),
    ({**BASE, "start_epoch": -1}, "'start_epoch' must be between 0"),
    ({**BASE, "sampler": "Distributed"}, 'did you mean "distributed"?'),
    ({**BASE, "sampler": 3}, "'sampler' must be one of"),
    ({**BASE, "ranks": []}, "non-empty list"),
    ({**BASE, "ranks": 0}, "non-empty list"),
    ({**BASE, "ranks": [0, 16]}, "rank 16 (an integer) is outside [0, 16)"),
    ({**BASE, "ranks": [0, -1]}, "outside"),
    ({**BASE, "ranks": [0, 1, 0]}, "lists rank 0 more than once"),
    ({**BASE, "ranks": [0, False]}, "integers only"),
    ({**BASE, "num_replicas": 0}, "'num_replicas' must be between 1"),
    ({**BASE, "shuffle": 1}, "'shuffle' must be true or false, got 1 (an integer)"),
    ({**BASE, "drop_last": None}, "'drop_last' must be true or false, got null"),
    ({**BASE, "batch_size": 0}, "'batch_size' must be between 1"),
    ({**BASE, "num_workers": -1}, "'num_workers' must be between 0"),
    ({**BASE, "prefetch_factor": 0}, "'prefetch_factor' must be between 1"),
    ({**BASE, "seed": 2**64}, "'seed' must be between"),
    ({**BASE, "seed": 2**64 - 1}, "overflows"),
    ({**BASE, "seed": -(2**63) - 1}, "'seed' must be between"),
    ({**BASE, "order": "list"}, "'list_file' is required"),
    ({**BASE, "list_file": "a.txt"}, "'list_file' applies only to order \"list\""),
    ({**BASE, "order": "sortd"}, 'did you mean "sorted"?'),
    ({"epochs": 1, "sampler": "random", "ranks": [0]}, "'ranks' applies only to sampler \"distributed\""),
    ({"epochs": 1, "sampler": "random", "indices_file": "x"}, "applies only to sampler \"indices\""),
    ({"epochs": 1, "sampler": "indices"}, "'indices_file' is required"),
    ({"epochs": 1, "sampler": "indices", "indices_file": "/etc/passwd"}, "absolute path"),
    ({"epochs": 1, "sampler": "indices", "indices_file": "a/../../x"}, "'..' is not allowed"),
    ({"epochs": 1, "sampler": "indices", "indices_file": "./"}, "must name a file"),
    ({"epochs": 1, "sampler": "indices", "indices_file": ""}, "non-empty"),
    ({"epochs": 1, "sampler": "indices", "indices_file": "a\x00b"}, "NUL"),
    ({"epochs": 1, "sampler": "indices", "indices_file": 5}, "path string"),
    ({"epochs": 1, "sampler": "indices", "indices_file": "\ud800"}, "UTF-8"),
    ([BASE], "must hold a JSON object, got a list"),
    ("plan", "must hold a JSON object"),
    (b'{"epochs": 1, "epochs": 2, "sampler": "random"}', "key \"epochs\" appears more than once"),
    (b'{"epochs": NaN, "sampler": "random"}', "NaN is not allowed"),
    (b'{"epochs": Infinity, "sampler": "random"}', "Infinity is not allowed"),
    (b'{"epochs": 1, "sampler": "random"', "invalid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"   \n", "empty"),
    (b"", "empty"),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"epochs": ' + b"9" * 5000 + b', "sampler": "random"}', "too many digits"),
    (b" " * (MAX_PLAN_BYTES + 1), "larger than"),
])
def test_errors_name_the_problem(doc: Any, needle: str) -> None:
    msg = _err(doc)
    assert needle in msg
    assert msg.startswith("plan: ")
    msg.encode("utf-8")  # shown in .fsd/error


def test_non_bytes_input_is_a_plan_error() -> None:
    with pytest.raises(PlanError):
        parse_plan("{}")  # type: ignore[arg-type]


def test_bytearray_and_memoryview_accepted() -> None:
    raw = json.dumps(BASE).encode()
    assert parse_plan(bytearray(raw)) == parse_plan(memoryview(raw)) == _p(BASE)


def test_exactly_max_bytes_is_parsed_not_refused_for_size() -> None:
    raw = json.dumps(BASE).encode()
    raw = raw + b" " * (MAX_PLAN_BYTES - len(raw))
    assert len(raw) == MAX_PLAN_BYTES
    assert parse_plan(raw) == _p(BASE)


def test_to_json_round_trips_and_is_explicit() -> None:
    for d in [BASE, {"epochs": 1, "sampler": "random"},
              {"epochs": 5, "start_epoch": 4, "sampler": "indices", "indices_file": "i.json", "order": "list",
               "list_file": "l.txt", "seed": -5}]:
        p = _p(d)
        j = json.loads(p.to_json())
        assert set(j) <= set(VALID_KEYS)
        assert parse_plan(p.to_json().encode()) == p
    assert "ranks" not in json.loads(_p({"epochs": 1, "sampler": "random"}).to_json())


def test_unexpected_internal_error_still_surfaces_as_plan_error(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    def boom(data: bytes) -> Plan:
        raise KeyError("x")

    monkeypatch.setattr(fsd.plan.document, "_parse", boom)
    with pytest.raises(PlanError, match="could not be parsed"):
        parse_plan(b"{}")
    assert "unexpected error" in caplog.text


# -- property tests (issue 5) ---------------------------------------------------------------------

def _parse_total(data: bytes) -> Plan | None:
    """The parser must return a Plan or raise PlanError with a printable message, nothing else.

    Calls ``_parse``, the part below parse_plan's last-resort catch-all, so that an
    unexpected exception type fails here instead of being papered over.
    """
    try:
        p = fsd.plan.document._parse(data)
    except PlanError as e:
        assert str(e).startswith("plan: ")
        str(e).encode("utf-8")
        return None
    assert isinstance(p, Plan)
    assert parse_plan(p.to_json().encode()) == p
    return p


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    _parse_total(data)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_fuzz_arbitrary_json_values(v: Any) -> None:
    _parse_total(json.dumps(v).encode())


_key = st.sampled_from(VALID_KEYS) | st.text(max_size=12)
_value = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(-3, 40) | st.floats()
          | st.sampled_from(["distributed", "random", "sequential", "indices", "imagefolder", "sorted", "list",
                             "a.txt", "../x", "/abs", "ok/f.npy", ""])
          | st.lists(st.integers(-2, 20), max_size=6) | st.lists(st.booleans(), max_size=2))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["set", "del"]), _key, _value), max_size=4))
def test_fuzz_mutations_of_a_valid_plan(muts: list[tuple[str, str, Any]]) -> None:
    d = dict(BASE)
    for op, k, v in muts:
        if op == "set":
            d[k] = v
        else:
            d.pop(k, None)
    raw = json.dumps(d, allow_nan=True).encode()  # NaN/Infinity literals must be refused, not crash
    p = _parse_total(raw)
    if p is not None:  # accepted plans satisfy every constraint
        assert 1 <= p.epochs and 0 <= p.start_epoch < p.epochs
        assert len(set(p.ranks)) == len(p.ranks) and all(0 <= r < p.num_replicas for r in p.ranks)
        assert p.batch_size >= 1 and p.num_workers >= 0 and p.prefetch_factor >= 1


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_valid_plans_round_trip(data: st.DataObject) -> None:
    epochs = data.draw(st.integers(1, 1000))
    sampler = data.draw(st.sampled_from(["distributed", "random", "sequential", "indices"]))
    d: dict[str, Any] = {"epochs": epochs, "sampler": sampler, "start_epoch": data.draw(st.integers(0, epochs - 1)),
                         "seed": data.draw(st.integers(-(2**63), 2**63)),
                         "batch_size": data.draw(st.integers(1, 4096)),
                         "num_workers": data.draw(st.integers(0, 64)),
                         "prefetch_factor": data.draw(st.integers(1, 16))}
    if sampler == "distributed":
        R = data.draw(st.integers(1, 2048))
        d.update(num_replicas=R, ranks=data.draw(st.lists(st.integers(0, R - 1), min_size=1, max_size=8, unique=True)),
                 shuffle=data.draw(st.booleans()), drop_last=data.draw(st.booleans()))
    if sampler == "indices":
        d["indices_file"] = data.draw(st.sampled_from(["ix.npy", "a/b/ix.json"]))
    d["order"] = data.draw(st.sampled_from(["imagefolder", "sorted", "list"]))
    if d["order"] == "list":
        d["list_file"] = "files.txt"
    p = _p(d)
    assert json.loads(p.to_json()) == {k: d[k] for k in json.loads(p.to_json())}
    assert parse_plan(p.to_json().encode()) == p
