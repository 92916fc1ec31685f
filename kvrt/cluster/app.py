"""The Ray Serve application: N kvrt replicas behind the affinity ingress.

:func:`build` makes it from Python (``serve.run(build(...))``); :func:`from_args` is the application builder a
Serve config file names (``import_path: kvrt.cluster.app:from_args``, with its ``args``), see
``examples/ray_serve/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from kvrt.cluster.affinity import DEFAULT_PREFIX_CHARS
from kvrt.cluster.ingress import Ingress
from kvrt.cluster.replica import KvrtReplica, ReplicaSpec
from kvrt.cluster.router import AffinityRouter
from kvrt.errors import KvrtError
from kvrt.runtime.admission import EngineConfig
from kvrt.serve.http_front import HttpOptions

REPLICA_DEPLOYMENT = "kvrt"
INGRESS_DEPLOYMENT = "kvrt-ingress"


def build(spec: ReplicaSpec, *, replicas: int = 2, prefix_chars: int = DEFAULT_PREFIX_CHARS,
          num_cpus: float = 1.0, num_gpus: float = 0.0, max_ongoing_requests: int | None = None) -> Application:
    """``replicas`` kvrt servers of ``spec`` (each reserving ``num_cpus`` and ``num_gpus`` of Ray's resources)
    behind one ingress. A replica is sent at most ``max_ongoing_requests`` requests at once (None: its engine's
    slots plus its queue, so kvrt's own admission decides, and answers 503 past it as a single server does)."""
    if replicas < 1:
        raise KvrtError(f"replicas must be >= 1, got {replicas}")
    if prefix_chars < 1:
        raise KvrtError(f"prefix_chars must be >= 1, got {prefix_chars}")
    if spec.http.state_dir is not None:
        # a replacement replica has a new id, so its agents hash elsewhere: what it saved would not come back
        raise KvrtError("http.state_dir: a cluster does not keep agents across replica restarts (a replica that "
                        "replaces another gets other agents), so saved agents are not supported here")
    ongoing = max_ongoing_requests or spec.engine.n_seq_max + spec.engine.max_queue
    replica = serve.deployment(KvrtReplica, name=REPLICA_DEPLOYMENT, num_replicas=replicas,
                               max_ongoing_requests=ongoing,
                               ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
                               request_router_config=RequestRouterConfig(request_router_class=AffinityRouter))
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT, max_ongoing_requests=ongoing * replicas,
                               ray_actor_options={"num_cpus": 0})
    app: Application = ingress.bind(replica.bind(spec), prefix_chars=prefix_chars,
                                    max_input_bytes=spec.http.max_input_bytes)
    return app


def from_args(args: Mapping[str, Any]) -> Application:
    """A Serve config's application builder: ``args`` holds ``http`` (:class:`HttpOptions`' fields; ``models`` a
    list of paths), ``engine`` (:class:`EngineConfig`'s), ``ledger`` (:class:`ReplicaSpec`'s ``capacity_bytes``,
    ``admit_percent``, ``n_gpu_layers``) and :func:`build`'s keywords (``replicas``, ``prefix_chars``,
    ``num_cpus``, ``num_gpus``, ``max_ongoing_requests``); a key that is none of these is refused by name."""
    http = _fields(HttpOptions, args.get("http", {}), "http")
    if "models" in http:
        http["models"] = tuple(Path(p) for p in http["models"])
    for name in ("models_dir", "state_dir"):
        if http.get(name) is not None:
            http[name] = Path(http[name])
    spec = ReplicaSpec(http=HttpOptions(**http), engine=EngineConfig(**_fields(EngineConfig, args.get("engine", {}),
                                                                               "engine")),
                       **_fields(ReplicaSpec, args.get("ledger", {}), "ledger", exclude={"http", "engine"}))
    keywords = {key: value for key, value in args.items() if key not in ("http", "engine", "ledger")}
    unknown = set(keywords) - {"replicas", "prefix_chars", "num_cpus", "num_gpus", "max_ongoing_requests"}
    if unknown:
        raise KvrtError(f"kvrt.cluster.app args: unknown key(s) {sorted(unknown)}")
    return build(spec, **keywords)


def _fields(kind: type, given: Mapping[str, Any], where: str, exclude: frozenset[str] | set[str] = frozenset()
            ) -> dict[str, Any]:
    """``given`` checked against ``kind``'s dataclass fields (less ``exclude``): a copy, or an error naming the
    unknown keys under ``where``."""
    known = {f.name for f in fields(kind)} - set(exclude)
    unknown = set(given) - known
    if unknown:
        raise KvrtError(f"kvrt.cluster.app args.{where}: unknown key(s) {sorted(unknown)} (known: {sorted(known)})")
    return dict(given)
