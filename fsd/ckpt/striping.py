"""Stripe layout of one checkpoint file across N devices.

File byte ``x`` lies in stripe ``k = x // stripe_size``; stripe ``k`` lives on
device ``(start + k) % N`` at local offset ``(k // N) * stripe_size +
x % stripe_size`` of that device's data file for the file. ``start`` rotates
per file so that many small files (DCP shards) spread over all devices.
Pure arithmetic: no I/O, unit-testable.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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

    def file_ranges(self, device: int, local_off: int, length: int) -> Iterator[tuple[int, int]]:
        """File ranges ``(offset, length)``, in file order, that bytes [local_off, local_off+length)
        of *device*'s data file hold: the inverse of :meth:`extents`, one range per stripe touched
        (the drain maps a device file's data segments back to the file with it)."""
        s, n = self.stripe_size, self.n_devices
        first = (device - self.start) % n  # the file stripe at the device's local offset 0
        end = local_off + length
        while local_off < end:
            j = local_off // s
            within = local_off - j * s
            m = min(s - within, end - local_off)
            yield (j * n + first) * s + within, m
            local_off += m

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


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """Ranges ``(offset, length)`` sorted by offset, with overlapping and adjacent ones joined
    (empty ones dropped)."""
    cur_off, cur_end = 0, -1
    for off, n in ranges:
        if n <= 0:
            continue
        if off <= cur_end:
            cur_end = max(cur_end, off + n)
            continue
        if cur_end > cur_off:
            yield cur_off, cur_end - cur_off
        cur_off, cur_end = off, off + n
    if cur_end > cur_off:
        yield cur_off, cur_end - cur_off
