"""fsd.plan.job: the whole-job plan format (loaders, roots, epochs), its defaults and its messages."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsd.plan.document import Plan, PlanError, parse_plan
from fsd.plan.job import JobPlan, Loader, from_single, parse_job

IMAGENET: dict[str, Any] = {
    "epochs": 90, "num_replicas": 8, "ranks": [0, 1, 2, 3],
    "loaders": [
        {"name": "train", "root": "train", "sampler": "distributed", "batch_size": 32, "num_workers": 8},
        {"name": "val", "root": "val", "sampler": "distributed", "shuffle": False, "drop_last": True,
         "batch_size": 32, "num_workers": 8},
        {"leftover_of": "val"},
    ]}


def _j(d: Any) -> JobPlan:
    return parse_job(json.dumps(d).encode())


def _err(d: Any) -> str:
    with pytest.raises(PlanError) as ei:
        parse_job(json.dumps(d).encode())
    return str(ei.value)


def test_imagenet_job_and_its_defaults() -> None:
    j = _j(IMAGENET)
    assert (j.epochs, j.start_epoch, j.num_replicas, j.ranks) == (90, 0, 8, (0, 1, 2, 3))
    train, val, rest = j.loaders
    assert train == Loader(name="train", sampler="distributed", root="train", ranks=(0, 1, 2, 3), batch_size=32,
                           num_workers=8)
    assert (train.seed, train.shuffle, train.drop_last, train.set_epoch, train.order) == (0, True, False, True,
                                                                                           "imagefolder")
    assert (val.shuffle, val.drop_last, val.every, val.first_epoch) == (False, True, 1, 0)
    assert rest == Loader(name="val_leftover", sampler="sequential", root="val", ranks=(0, 1, 2, 3), batch_size=32,
                          num_workers=8, leftover_of="val")
    assert j.window == 4 * 32 * 8 * 2
    assert list(j.remaining_epochs) == list(range(90))
    assert j.loader("val") is val
    assert not j.flat


def test_round_trip_through_to_dict() -> None:
    for doc in (IMAGENET, {"epochs": 3, "loaders": [
            {"root": "a/b", "order": "list", "list_file": "lists/a.txt", "sampler": "random", "seed": 5,
             "shares_generator": True, "persistent_workers": True, "every": 2, "first_epoch": 0,
             "subset": [3, 9], "drop_last_batch": True},
            {"root": ".", "sampler": "indices", "indices_file": "ix.npy", "ranks": [0]}]}):
        j = _j(doc)
        assert parse_job(j.to_json().encode()) == j
    assert _j(IMAGENET).to_dict()["loaders"][2] == {
        "name": "val_leftover", "leftover_of": "val", "ranks": [0, 1, 2, 3], "batch_size": 32, "num_workers": 8,
        "prefetch_factor": 2, "drop_last_batch": False}


def test_names_roots_and_epochs() -> None:
    j = _j({"epochs": 10, "loaders": [{"root": "./data//train/", "sampler": "sequential"},
                                      {"sampler": "sequential", "every": 5}]})
    a, b = j.loaders
    assert (a.name, a.root, b.name, b.root) == ("train", "data/train", "loader1", "")
    assert [e for e in range(10) if b.runs_in(e)] == [4, 9]  # after every 5th epoch
    assert [b.runs_before(e) for e in (0, 4, 5, 9, 10)] == [0, 0, 1, 1, 2]
    c = Loader(name="c", sampler="random", every=3, first_epoch=1)
    assert [e for e in range(8) if c.runs_in(e)] == [1, 4, 7]
    assert [c.runs_before(e) for e in range(8)] == [0, 0, 1, 1, 1, 2, 2, 2]


def test_single_loader_documents_are_jobs_of_one_loader() -> None:
    doc = {"seed": 7, "epochs": 3, "sampler": "distributed", "num_replicas": 4, "ranks": [1, 3], "batch_size": 2}
    j = parse_job(json.dumps(doc).encode())
    plan = parse_plan(json.dumps(doc).encode())
    assert j.flat and j == from_single(plan)
    assert parse_job(j.to_json().encode()) == j and "loaders" in j.to_dict()  # its canonical form is a job's
    (ld,) = j.loaders
    assert (ld.root, ld.ranks, j.num_replicas, j.ranks, ld.seed) == ("", (1, 3), 4, (1, 3), 7)
    seq = from_single(Plan(epochs=2, sampler="random", seed=3))
    assert (seq.ranks, seq.loaders[0].ranks, seq.num_replicas) == ((0,), (0,), 1)
    # the single plan's messages are unchanged
    assert _err({"epochs": 3, "sampler": "distributed", "num_replicas": 2}).startswith("plan: 'ranks' is required")


def _with(i: int, **kw: Any) -> dict[str, Any]:
    d = json.loads(json.dumps(IMAGENET))
    d["loaders"][i].update(kw)
    return d


@pytest.mark.parametrize("doc,needle", [
    ({**IMAGENET, "loaders": []}, "'loaders' must be a non-empty list"),
    ({**IMAGENET, "loaders": {"train": {}}}, "'loaders' must be a non-empty list of loader objects"),
    ({**IMAGENET, "loaders": [3]}, "plan: loader 0: each loader must be a JSON object, got 3 (an integer)"),
    ({**IMAGENET, "sampler": "distributed"}, "'sampler' belongs in each loader when the plan has 'loaders'"),
    ({**IMAGENET, "epoch": 3}, "unknown key 'epoch' (did you mean 'epochs'?) in a job plan"),
    ({k: v for k, v in IMAGENET.items() if k != "ranks"}, "'ranks' is required when 'num_replicas' > 1"),
    ({**IMAGENET, "ranks": [0, 8]}, "rank 8 (an integer) in the job's 'ranks' is outside [0, 8)"),
    ({**IMAGENET, "ranks": []}, "the job's 'ranks' must list at least one rank"),
    ({**IMAGENET, "start_epoch": 90}, "'start_epoch' (90) must be less than 'epochs' (90)"),
    (_with(0, sampler="Distributed"), 'plan: loader 0 \'train\': \'sampler\' must be one of'),
    (_with(0, sampler="distributed", ranks=[0]), "'ranks' applies only to sampler"),
    (_with(0, epochs=3), "'epochs' belongs to the job, not to a loader"),
    (_with(0, num_replica=3), "unknown key 'num_replica' (did you mean 'num_replicas'? it belongs to the job)"),
    (_with(0, root="/data/train"), "'root' must be relative to the dataset root"),
    (_with(0, root="../other"), "'root' must stay inside the dataset root"),
    (_with(0, root="/"), "'root' must be relative to the mount root"),
    (_with(0, root=3), "'root' must be a path string"),
    (_with(1, name="train"), "two loaders are named 'train'"),
    (_with(1, name=""), "'name' must be a printable string"),
    (_with(0, shares_generator=True), "'shares_generator' applies only to sampler \"random\""),
    (_with(0, seed=2**64), "'seed' must be between"),
    (_with(0, every=0), "'every' must be between 1"),
    (_with(0, subset=[5, 2]), "'subset' must be [start, stop] with 0 <= start <= stop"),
    (_with(0, subset="0:9"), "'subset' must be [start, stop]"),
    (_with(0, order="list"), "'list_file' is required when 'order' is \"list\""),
    (_with(0, sampler="indices"), "'indices_file' is required"),
    (_with(2, leftover_of="nope"), "'leftover_of' must name an earlier loader (earlier: train, val)"),
    (_with(2, leftover_of="val", root="val"), "'root' does not apply to a 'leftover_of' loader"),
    ({**IMAGENET, "loaders": [IMAGENET["loaders"][2], *IMAGENET["loaders"][:2]]}, "must name an earlier loader"),
    ({**IMAGENET, "loaders": [{"root": "val", "sampler": "sequential"}, {"leftover_of": "val"}]},
     "which is not a distributed loader"),
    ({"epochs": 2, "loaders": [{"sampler": "sequential", "ranks": [0, 1]}]}, "is outside [0, 1)"),
    ({"epochs": 2, "num_replicas": 4, "ranks": [0, 1], "loaders": [{"sampler": "sequential", "ranks": [2]}]},
     "may list only the job's ranks on this node [0, 1], not [2]"),
    ({"epochs": 2, "loaders": [{"sampler": "random", "persistent_workers": True}]},
     "'persistent_workers' matters only with 'shares_generator': true"),
])
def test_invalid_job_plans(doc: dict, needle: str) -> None:
    assert needle in _err(doc)


_value = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**65) | st.text(max_size=8),
                      lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                      max_leaves=6)
_loader_key = st.sampled_from(["name", "root", "sampler", "seed", "every", "subset", "leftover_of", "ranks",
                               "shuffle", "batch_size"]) | st.text(max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loaders=st.lists(st.dictionaries(_loader_key, _value, max_size=5), max_size=3), top=st.dictionaries(
    st.sampled_from(["epochs", "start_epoch", "num_replicas", "ranks"]), _value, max_size=4))
def test_fuzzed_job_plans_give_a_plan_or_a_plan_error(loaders: list, top: dict) -> None:
    """Any document gives a JobPlan or a PlanError with a message, never another exception."""
    try:
        j = parse_job(json.dumps({"epochs": 2, **top, "loaders": loaders}).encode())
    except PlanError as e:
        assert str(e).startswith("plan: ")
        return
    assert parse_job(j.to_json().encode()) == j
