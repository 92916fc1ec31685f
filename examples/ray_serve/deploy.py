"""N kvrt replicas behind Ray Serve, requests routed by agent and prefix affinity (see README.md beside this file).

    python examples/ray_serve/deploy.py --replicas 2                 # a local Ray cluster, the demo model
    python examples/ray_serve/deploy.py --address auto --num-gpus 1  # an existing cluster, a GPU per replica

Serves OpenAI's API at http://HOST:PORT/v1 until Ctrl-C.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import ray
from ray import serve

from kvrt.cluster.app import build
from kvrt.cluster.replica import ReplicaSpec
from kvrt.runtime.admission import EngineConfig
from kvrt.serve.http_front import HttpOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2, help="kvrt servers, each with its own engines")
    parser.add_argument("--model", action="append", default=[], help="a GGUF file (repeatable; none: the demo model)")
    parser.add_argument("--address", default=None, help="a Ray cluster to join ('auto': the local one; none: start "
                                                        "one in this process)")
    parser.add_argument("--host", default="127.0.0.1", help="where Serve's HTTP proxy listens")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--n-ctx", type=int, default=4096, help="cells per model per replica")
    parser.add_argument("--slots", type=int, default=8, help="requests decoded together per replica")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per replica's context")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs each replica reserves")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="Ray GPUs each replica reserves (1: one each)")
    parser.add_argument("--prefix-chars", type=int, default=1024,
                        help="an anonymous prompt's opening characters that pick its replica")
    args = parser.parse_args()

    spec = ReplicaSpec(http=HttpOptions(models=tuple(Path(p) for p in args.model)),
                       engine=EngineConfig(n_ctx=args.n_ctx, n_seq_max=args.slots, n_threads=args.threads,
                                           host_bytes=1 << 30))
    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build(spec, replicas=args.replicas, prefix_chars=args.prefix_chars, num_cpus=args.num_cpus,
                    num_gpus=args.num_gpus), name="kvrt", route_prefix="/")
    print(f"kvrt on Ray Serve: http://{args.host}:{args.port}/v1 ({args.replicas} replicas); Ctrl-C stops it",
          flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        serve.shutdown()


if __name__ == "__main__":
    main()
