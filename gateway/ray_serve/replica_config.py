"""What a gateway replica runs with: `voxgate serve`'s configuration, on the proxy's address.

A gateway replica builds its `GatewayConfig` with the same `load_config` as
`voxgate serve`: the app's `gateway` args as options, over the replica
process's own VOXGATE_* variables, keys included (docs/operations.md, "Keys
on Ray Serve"). Key values never travel in Serve's args or runtime_env, which
Ray keeps in its control store and shows on its dashboard; only a keys
file's path may.

What a client reaches is Serve's proxy, not the replica, so the replica
takes `host` and `port` from the proxy's HTTP options (whatever its args
say) and checks exposure as `voxgate serve` does: on a non-loopback proxy
with no key loaded here and no `no_auth`, it refuses to start
(`check_exposure` raises), and the deploy fails instead of serving everyone
as the operator. When the proxy's options cannot be read, the replica counts
itself exposed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from gateway.access.origins import check_exposure
from gateway.config import GatewayConfig, load_config

log = logging.getLogger("voxgate.gateway")

#: the address a replica assumes when it cannot learn the proxy's: exposed, so keys are needed
EXPOSED_HOST = "0.0.0.0"


async def proxy_address() -> tuple[str, int]:
    """The Serve proxy's bind host and port, from Serve's controller (an actor call)."""
    try:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        http = await controller.get_http_config.remote()
        return (str(http.host) if http.host else EXPOSED_HOST), int(http.port)
    except Exception as exc:  # noqa: BLE001 - another Ray version, no controller: fail closed
        log.warning("the Serve proxy's address is unknown (%s: %s); this replica counts itself "
                    "exposed and needs API keys or no_auth", type(exc).__name__, exc)
        return EXPOSED_HOST, 0


def replica_config(options: Mapping[str, Any], proxy_host: str, proxy_port: int,
                   environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """The replica's config; raises ValueError where `voxgate serve` would refuse to start."""
    config = load_config({**options, "host": proxy_host, "port": proxy_port}, environ)
    log.info("gateway replica behind a proxy on %s: %s", proxy_host,
             check_exposure(config.host, config.auth))
    return config
