"""fsd: a clairvoyant FUSE filesystem for deep-learning training I/O.

Two mounts: a read-only dataset view that prefetches by the known sampler order
into RAM/SSD tiers, and a checkpoint directory that accepts writes at memory
speed and stripes them across several NVMe devices in the background.
"""

__version__ = "0.1.0"
