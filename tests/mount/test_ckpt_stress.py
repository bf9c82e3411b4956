"""Model-checked stress of the checkpoint mount (tests/ckpt_stress.py): 4 processes doing random
operations with the drain on, then every file and the whole tree compared with the model, through
the mount and in the backing directory, after a clean unmount, a ``--no-wait-drain`` unmount, a
mount on emptied devices, and a SIGKILL.

A failure names its seed; replay it with ``FSD_STRESS_SEED=N pytest tests/mount/test_ckpt_stress.py``
(all variants) or ``tools/ckpt-stress --start N --seeds 1``. Many seeds: ``tools/ckpt-stress --seeds 20``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ckpt_stress
import pytest
from ckpt_stress import Config, seeds_from_env

pytestmark = [pytest.mark.mount, pytest.mark.timeout(270)]


@pytest.mark.parametrize("seed", seeds_from_env([1]))
def test_random_ops_then_clean_unmounts_match_the_model(seed: int, tmp_path: Path, mounter: Any) -> None:
    ckpt_stress.run(Config(seed, ops=40), tmp_path, mounter)


@pytest.mark.parametrize("seed", seeds_from_env([2]))
def test_random_ops_then_sigkill_keep_what_the_design_promises(seed: int, tmp_path: Path, mounter: Any) -> None:
    ckpt_stress.run(Config(seed, kill=True, ops=60), tmp_path, mounter)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", seeds_from_env(list(range(100, 108))))
def test_long_random_ops_then_clean_unmounts_match_the_model(seed: int, tmp_path: Path, mounter: Any) -> None:
    ckpt_stress.run(Config(seed, ops=200), tmp_path, mounter)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", seeds_from_env(list(range(200, 208))))
def test_long_random_ops_then_sigkill_keep_what_the_design_promises(seed: int, tmp_path: Path,
                                                                     mounter: Any) -> None:
    ckpt_stress.run(Config(seed, kill=True, ops=300), tmp_path, mounter)
