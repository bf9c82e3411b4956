"""An ImageFolder-compatible dataset for tests and the test job (torchvision is not installable beside
the torch build used here): the same class discovery and sample order as
``torchvision.datasets.ImageFolder`` (``find_classes`` + ``make_dataset``), with ``root``,
``classes``, ``class_to_idx``, ``samples``, ``imgs`` and ``targets``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class ImageFolder(Dataset):
    """``ImageFolder(root, transform, loader)``: ``__getitem__`` returns ``(transform(loader(path)), target)``."""

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[Any], Any] | None = None,
                 loader: Callable[[str], Any] = read_bytes) -> None:
        self.root = os.fspath(root)
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        if not self.classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {self.root}.")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        samples: list[tuple[str, int]] = []
        for cls in sorted(self.class_to_idx):
            for dirpath, _, fnames in sorted(os.walk(os.path.join(self.root, cls), followlinks=True)):
                for fname in sorted(fnames):
                    path = os.path.join(dirpath, fname)
                    if path.lower().endswith(IMG_EXTENSIONS):
                        samples.append((path, self.class_to_idx[cls]))
        self.samples = samples
        self.imgs = samples
        self.targets = [t for _, t in samples]
        self.transform = transform
        self.loader = loader

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path, target = self.samples[i]
        x = self.loader(path)
        return (self.transform(x) if self.transform is not None else x), target
