"""The node's merged future access stream (contract; built out by the planner)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NodeStream:
    """Predicted accesses of every rank on this node, in expected time order.

    ``file_ids[i]`` is the backend file id of the i-th predicted access;
    ``epoch_bounds[e] : epoch_bounds[e+1]`` slices epoch ``start_epoch + e``;
    ``ranks[i]`` is the rank that makes access i; ``window`` is the reorder
    slack (entries) that DataLoader workers may introduce.
    """

    file_ids: np.ndarray
    epoch_bounds: np.ndarray
    ranks: np.ndarray
    start_epoch: int
    window: int
