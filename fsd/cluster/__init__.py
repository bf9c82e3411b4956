"""Cluster mode: the nodes of a job share one clairvoyant cache and read the PFS once per cluster.

- :mod:`.config` - the cluster file / ``[data.cluster]`` table, Slurm derivation, node -> ranks.
- :mod:`.ownership` - the owner node of every file, computed identically on every node; the plan fingerprint.
- :mod:`.transport` - gRPC peer service (batched streaming fetches), ``Peers`` client, per-peer counters.
- :mod:`.metrics` - optional Prometheus exporter of the same counters.

See docs/CLUSTER.md for the design and the interface the dataset cache uses.
"""
