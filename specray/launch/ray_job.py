"""The ``ray job submit`` entry point: ``specray generate | bench | serve`` on a Ray cluster.

    ray job submit --address http://HEAD:8265 -- \\
        python -m specray.launch.ray_job generate --model tiny-llama --tp 4 --prompt-ids 1,2,3
    ray job submit --address http://HEAD:8265 --no-wait -- \\
        python -m specray.launch.ray_job serve --model smollm2-135m --tp 3 --host 0.0.0.0 --port 8000

It takes exactly the flags of ``specray generate``, ``bench`` and ``serve`` (the parser and the
config builder of ``specray/cli.py``), runs the ranks under the ``ray`` launcher, and prints
what the CLI prints. ``serve`` runs the HTTP server on the job's driver (the node ``ray job
submit`` starts it on, the head unless told otherwise) and the ranks as actors placed by Ray;
``ray job stop`` stops it (SIGTERM: uvicorn's graceful shutdown, then the ranks).

The cluster is ``--ray-address``, else RAY_ADDRESS (``ray job submit`` sets it for the job), else
the cluster ``ray start`` ran on this node if its head answers; with none, a local instance is
started for the run and stopped after it (``specray.launch.ray_connect``).
"""

from __future__ import annotations

import sys

from specray import cli


def main(argv: list[str] | None = None) -> int:
    import ray

    from specray.launch.ray_connect import connect_ray

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse already printed the error
        return int(exit_.code or 0)
    if args.launcher not in ("auto", "ray"):
        print(f"error: ray_job runs the ranks as Ray actors; drop --launcher {args.launcher} (or pass ray)",
              file=sys.stderr)
        return cli.EXIT_USAGE
    is_local = connect_ray(args.ray_address)
    print(f"specray ray_job: {'started a local Ray instance' if is_local else 'connected to the Ray cluster'} "
          f"({len([n for n in ray.nodes() if n['Alive']])} nodes, {ray.cluster_resources().get('CPU', 0):g} CPUs, "
          f"{ray.cluster_resources().get('GPU', 0):g} GPUs)", flush=True)
    try:
        return cli.main([*argv, "--launcher", "ray"])  # the last --launcher wins
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
