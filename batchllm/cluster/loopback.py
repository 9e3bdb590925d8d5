"""Keep a one-machine Ray cluster on 127.0.0.1.

Ray rewrites a loopback address given to `ray start --node-ip-address` or `ray.init`
into the host's interface address (`ray._private.services.resolve_ip_for_localhost`),
so that other machines could join: measured with Ray 2.60.0, `--node-ip-address=127.0.0.1`
gave nodes at the eth0 address and a driver that connected there. For a cluster of
several nodes on one machine (tests, trials) nothing needs to be reachable from
elsewhere, so this module skips that rewrite: the GCS and raylets listen on 127.0.0.1.

    python -m batchllm.cluster.loopback start --head --node-ip-address=127.0.0.1 ...

is `ray start ...` with the rewrite skipped (any `ray` subcommand works).
"""

from __future__ import annotations

import sys

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


def is_loopback(address: str) -> bool:
    """`127.0.0.1:6390`, `localhost:6390`, `ray://127.0.0.1:10001`."""
    host = address.removeprefix("ray://").rsplit(":", 1)[0]
    return host in LOOPBACK_HOSTS


def keep_on_loopback() -> None:
    """Loopback addresses stay loopback in this process (see the module's note)."""
    import ray._private.services as services

    services.resolve_ip_for_localhost = _unchanged


def _unchanged(host: str) -> str:
    return host


def main() -> int:
    keep_on_loopback()
    from ray.scripts.scripts import cli

    return cli.main(args=sys.argv[1:], prog_name="ray")


if __name__ == "__main__":
    sys.exit(main())
