"""The dataset mount: a read-only view served from clairvoyant tiers and the kernel page cache."""
