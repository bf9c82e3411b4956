"""Stripe layout of one checkpoint file across N devices.

File byte ``x`` lies in stripe ``k = x // stripe_size``; stripe ``k`` lives on
device ``(start + k) % N`` at local offset ``(k // N) * stripe_size +
x % stripe_size`` of that device's data file for the file. ``start`` rotates
per file so that many small files (DCP shards) spread over all devices.
Pure arithmetic: no I/O, unit-testable.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

ALIGN = 4096
"""O_DIRECT alignment for offsets, lengths and buffers."""


def align_up(n: int, a: int = ALIGN) -> int:
    """Round *n* up to a multiple of *a*."""
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Extent:
    """A contiguous piece of a file range that lies on one device."""

    device: int
    local_off: int
    file_off: int
    length: int


@dataclass(frozen=True)
class Layout:
    """Stripe layout of one file: stripe size, device count, first device."""

    stripe_size: int
    n_devices: int
    start: int = 0

    def __post_init__(self) -> None:
        if self.stripe_size <= 0 or self.stripe_size % ALIGN:
            raise ValueError(f"stripe size {self.stripe_size} is not a positive multiple of {ALIGN}")
        if self.n_devices <= 0:
            raise ValueError("need at least one device")
        if not 0 <= self.start < self.n_devices:
            raise ValueError(f"start device {self.start} out of range")

    def device_of(self, stripe: int) -> int:
        """Device index holding stripe number *stripe*."""
        return (self.start + stripe) % self.n_devices

    def local_offset(self, stripe: int) -> int:
        """Offset of stripe *stripe* within its device's data file."""
        return (stripe // self.n_devices) * self.stripe_size

    def extents(self, off: int, length: int) -> Iterator[Extent]:
        """Per-device pieces of file range [off, off+length), in file order."""
        end = off + length
        s = self.stripe_size
        while off < end:
            k = off // s
            within = off - k * s
            n = min(s - within, end - off)
            yield Extent(self.device_of(k), self.local_offset(k) + within, off, n)
            off += n

    def local_lengths(self, size: int) -> list[int]:
        """Length of each device's data file needed to hold a file of *size* bytes."""
        out = [0] * self.n_devices
        s = self.stripe_size
        n_stripes = (size + s - 1) // s
        # Only the last stripe on each device matters; the last N stripes cover all devices.
        for k in range(max(0, n_stripes - self.n_devices), n_stripes):
            d = self.device_of(k)
            out[d] = max(out[d], self.local_offset(k) + min(s, size - k * s))
        return out

    def max_size(self, local_max: int) -> int:
        """The largest file size whose bytes all lie below *local_max* in their device's data file
        (the devices' largest file size): whole rounds of stripes, then the head of the next stripe."""
        s = self.stripe_size
        return self.n_devices * (local_max // s) * s + local_max % s
