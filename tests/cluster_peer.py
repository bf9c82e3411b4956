"""A peer process for the emulated-cluster tests: ``serve`` files of a directory, or ``fetch`` them.

    python tests/cluster_peer.py serve ADDR SECRET_FILE DIR N   # prints "ready PORT", serves until stdin closes
    python tests/cluster_peer.py fetch ADDR SECRET_FILE DIR N   # prints one JSON object
File id i is DIR/f{i}.bin; the fetcher compares what it gets with what it reads from DIR itself.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from fsd.cluster.config import read_secret
from fsd.cluster.transport import PeerClient, PeerServer

FP = "e" * 64


def main() -> int:
    mode, addr, secret_file, root, n = sys.argv[1:6]
    secret, n_files, d = read_secret(secret_file), int(n), Path(root)
    if mode == "serve":
        s = PeerServer(addr, secret, node=1, n_files=n_files, serve=lambda i, down: (d / f"f{i}.bin").read_bytes(),
                       fingerprint=FP)
        print("ready", s.start(), flush=True)
        sys.stdin.read()
        s.stop(0)
        return 0
    c = PeerClient(1, addr, secret, self_node=0, fingerprint=lambda: FP, fetch_timeout=20, connect_timeout=5)
    got = dict(c.fetch(range(n_files)))
    exact = all(got[i] == (d / f"f{i}.bin").read_bytes() for i in range(n_files))
    print(json.dumps({"exact": exact, "bytes": sum(len(v or b"") for v in got.values()),
                      "sha": hashlib.sha256(b"".join(got[i] or b"" for i in range(n_files))).hexdigest(),
                      "state": c.stats.state}))
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
