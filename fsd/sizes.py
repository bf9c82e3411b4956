"""Byte sizes as users write them (``512M``, ``4G``): the one parser the CLI and the cluster file share."""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'512M', '4G', '1.5T', '4096' -> bytes (binary units); argparse.ArgumentTypeError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGTB]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M, 4G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


__all__ = ["parse_size"]
