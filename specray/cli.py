"""`specray generate | chat | serve | bench | train-drafter`.

The engine and sampling flags are declared once (``add_engine_arguments``,
``add_sampling_arguments``) and shared by every subcommand; ``engine_config_from_args``
turns them into an ``EngineConfig``, so another entry point (a torchrun or Ray job script)
builds the same config from the same flags. Bad values surface as the ``ValueError`` of the
config dataclasses and print as one ``error: ...`` line with exit code 2.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time

from specray.config import (ALLREDUCE_MODES, DTYPES, LAUNCHERS, PLACEMENT_STRATEGIES, SPEC_METHODS, EngineConfig,
                            KVConfig, ParallelConfig, SamplingParams, SpecConfig)
from specray.envs import torchrun_env_present
from specray.serve.server import add_server_arguments

EXIT_USAGE = 2  # argparse's code for bad arguments; config errors use it too


class _Parser(argparse.ArgumentParser):
    """Bad flags print one ``error: ...`` line (with a pointer to --help), like config errors."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {message} (see `{self.prog} --help`)\n")


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of EngineConfig, ParallelConfig, KVConfig and SpecConfig (defaults are theirs)."""
    e, p, kv, s = EngineConfig(), ParallelConfig(), KVConfig(), SpecConfig()
    g = parser.add_argument_group("model and device")
    g.add_argument("--model", default=e.model, help="the built-in smollm2-135m, a random-weight preset, a Hugging "
                   "Face checkpoint directory or a .gguf file")
    g.add_argument("--device", default=e.device, help="cpu or cuda[:N]")
    g.add_argument("--dtype", default=e.dtype, choices=DTYPES)
    g.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs, help="requests decoded together")
    g.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens,
                   help="tokens one step computes: decode and verify rows first, prefill chunks fill the rest")
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel ranks, the world size (default: WORLD_SIZE under torchrun, else 1)")
    g.add_argument("--moe-tp", type=int, default=p.moe_tp_size, help="ways each expert is split")
    g.add_argument("--moe-ep", type=int, default=p.moe_ep_size, help="expert-parallel groups")
    g.add_argument("--launcher", default=p.launcher, choices=LAUNCHERS)
    g.add_argument("--allreduce", default=p.allreduce, choices=ALLREDUCE_MODES)
    g.add_argument("--timeout-s", type=float, default=p.timeout_s, help="limit of every collective and wait")
    g = parser.add_argument_group("Ray launcher")
    g.add_argument("--ray-address", default=p.ray_address,
                   help="Ray cluster to join (host:port, ray://..., or local); default: RAY_ADDRESS, else this "
                        "node's `ray start` cluster if its head answers, else a new local instance")
    g.add_argument("--placement-strategy", default=p.placement_strategy, choices=PLACEMENT_STRATEGIES,
                   help="how the ranks' placement group spreads over nodes")
    g.add_argument("--placement-timeout-s", type=float, default=p.placement_timeout_s,
                   help="fail when the placement group is not placed within this time")
    g.add_argument("--failure-timeout-s", type=float, default=p.failure_timeout_s,
                   help="a dead or hung rank fails the call within this time")
    g = parser.add_argument_group("KV pools")
    g.add_argument("--tokens-per-block", type=int, default=kv.tokens_per_block, help="page size (power of two)")
    g.add_argument("--kv-capacity-tokens", type=int, default=kv.capacity_tokens,
                   help="token capacity of each pool (default: sized from free memory)")
    g.add_argument("--kv-memory-fraction", type=float, default=kv.memory_fraction,
                   help="fraction of free memory the pools may take")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=kv.enable_prefix_caching,
                   help="share cached pages of common prompt prefixes (every pool; --no-enable-prefix-caching: off)")
    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--spec", default=s.method, choices=SPEC_METHODS, help="drafting method (default: plain)")
    g.add_argument("--draft-model", default=s.draft_model, help="drafter preset or checkpoint directory")
    g.add_argument("--num-draft-tokens", type=int, default=s.num_draft_tokens, help="k: drafts per verify step")
    g.add_argument("--force-accepted-tokens", type=float, default=s.force_accepted_tokens,
                   help="benchmarking only, changes outputs: accept this many drafts per step")
    g.add_argument("--prompt-lookup-min", type=int, default=s.prompt_lookup_min,
                   help="ngram: shortest n-gram to match (default: --prompt-lookup-max, else 5)")
    g.add_argument("--prompt-lookup-max", type=int, default=s.prompt_lookup_max,
                   help="ngram: longest n-gram to match, tried first (default: --prompt-lookup-min, else 5)")
    g.add_argument("--prompt-lookup-spec-factor", type=float, default=s.prompt_lookup_spec_factor,
                   help="ngram: draft at most this many tokens per matched token (a 2-gram match at 2.0: up to 4), "
                        "and at most k (default: up to k whatever the match)")
    g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=s.adaptive,
                   help="choose each request's draft length per step, 0 to --num-draft-tokens, from a measured "
                        "step-cost model and its acceptance (default: off, k every step)")
    g.add_argument("--dspark-confidence-threshold", type=float, default=s.dspark_confidence_threshold,
                   help="dspark: stop a sequence's drafts where the product of its confidence head's "
                        "predictions falls below this (default: off, always k drafts)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    sp = SamplingParams()
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=sp.temperature, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=sp.top_k, help="0 disables top-k")
    g.add_argument("--top-p", type=float, default=sp.top_p)
    g.add_argument("--seed", type=int, default=sp.seed,
                   help="sampling seed of the request(s); bench also seeds its random prompts with it")


def _torchrun_world_size() -> int:
    """Under torchrun (or mpirun/Slurm with torchrun's variables) the job's world size is the
    natural tensor-parallel size; the same test makes launcher auto pick ``external``."""
    return int(os.environ["WORLD_SIZE"]) if torchrun_env_present() else 1


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags describe; raises ValueError naming a bad value."""
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        parallel=ParallelConfig(tp_size=args.tp or _torchrun_world_size(), moe_tp_size=args.moe_tp, moe_ep_size=args.moe_ep,
                                launcher=args.launcher, allreduce=args.allreduce, timeout_s=args.timeout_s,
                                placement_strategy=args.placement_strategy, ray_address=args.ray_address,
                                placement_timeout_s=args.placement_timeout_s,
                                failure_timeout_s=args.failure_timeout_s),
        kv=KVConfig(tokens_per_block=args.tokens_per_block, capacity_tokens=args.kv_capacity_tokens,
                    memory_fraction=args.kv_memory_fraction, enable_prefix_caching=args.enable_prefix_caching),
        spec=SpecConfig(method=args.spec, draft_model=args.draft_model, num_draft_tokens=args.num_draft_tokens,
                        force_accepted_tokens=args.force_accepted_tokens,
                        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
                        prompt_lookup_spec_factor=args.prompt_lookup_spec_factor,
                        dspark_confidence_threshold=args.dspark_confidence_threshold,
                        adaptive=args.adaptive),
    )


def config_from_flags(flags: list[str], base: argparse.Namespace) -> EngineConfig:
    """``base``'s engine flags with ``flags`` (e.g. ``["--num-draft-tokens", "5"]``) applied on top."""
    parser = _Parser(prog="specray", add_help=False)
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(flags, namespace=copy.copy(base)))


def sampling_params_from_args(args: argparse.Namespace, **overrides) -> SamplingParams:
    fields = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    return SamplingParams(**{**fields, **overrides})


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specray", description="speculative-decoding LLM inference")
    commands = parser.add_subparsers(dest="command", required=True)
    shared = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(shared)
    add_sampling_arguments(shared)

    gen = commands.add_parser("generate", parents=[shared], help="generate from one prompt")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer")
    prompt.add_argument("--prompt-ids", type=_int_list, help="token ids, e.g. 1,2,3")
    gen.add_argument("--max-tokens", type=int, default=SamplingParams().max_tokens)
    gen.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens even past EOS")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.set_defaults(run=run_generate)

    chat = commands.add_parser("chat", parents=[shared], help="an interactive chat (one turn per line, /exit)")
    chat.add_argument("--system", help="a system prompt")
    chat.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer")
    chat.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    chat.set_defaults(run=run_chat)

    engine_only = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(engine_only)
    serve = commands.add_parser("serve", parents=[engine_only], help="an OpenAI-compatible HTTP server")
    add_server_arguments(serve)
    serve.set_defaults(run=run_serve)

    bench = commands.add_parser("bench", parents=[shared], help="plain-decoding throughput and latency sweep")
    bench.add_argument("--input-len", type=int, default=128)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--batch-sizes", type=_int_list, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    bench.add_argument("--warmup", type=int, default=1, help="untimed calls before each measured one")
    bench.add_argument("--json", metavar="PATH", help="write the rows and configs as JSON")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--plot", metavar="FILE.png", help="draw tok/s against batch size (plain and, with --spec, "
                       "speculative decoding, which runs both) and the per-position acceptance rate")
    bench.set_defaults(run=run_bench)
    from specray.same_text_cli import add_same_text_arguments
    from specray.training.cli import add_train_drafter_parser

    add_same_text_arguments(bench)
    add_train_drafter_parser(commands)
    return parser


def _print_geometry(llm) -> None:
    for name, geometry in llm.geometry.items():
        print(geometry.describe(name))


def _print_stats(out, elapsed: float, file=None) -> None:
    n, m = len(out.token_ids), out.metrics
    line = (f"{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tok/s (TTFT {m['ttft_s'] * 1e3:.1f} ms, "
            f"TPOT {m['tpot_s'] * 1e3:.2f} ms, finish: {out.finish_reason})")
    if "acceptance_length" in m:
        line += f", acceptance length {m['acceptance_length']:.2f}"
    print(line, file=file or sys.stdout)


def run_generate(args: argparse.Namespace) -> int:
    from specray.launch import resolve_launcher

    config = engine_config_from_args(args)
    if args.max_tokens < 1:  # 0 runs the prompt only (prompt log-probabilities): nothing to print here
        raise ValueError(f"--max-tokens ({args.max_tokens}) must be >= 1 for specray generate")
    params = sampling_params_from_args(args, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                                       stop=tuple(args.stop))
    prompt = args.prompt if args.prompt is not None else args.prompt_ids
    if resolve_launcher(config) == "external":  # every torchrun rank runs this: the batch call, rank 0 prints
        return _generate_on_every_rank(config, prompt, params, args)
    from specray.async_llm import AsyncLLM
    from specray.terminal import stream_to_terminal

    llm = AsyncLLM(config)
    try:
        _print_geometry(llm)
        is_text = args.prompt is not None
        start = time.perf_counter()
        # with token-id prompts and a model without a tokenizer there is no text: no empty line either
        out = stream_to_terminal(llm, prompt, params, end_line=is_text)
        elapsed = time.perf_counter() - start
        if out.text and not is_text:
            print()
    finally:
        llm.close()
    if args.prompt_ids is not None:
        print("output ids:", ",".join(map(str, out.token_ids)))
    _print_stats(out, elapsed)
    return 0


def _generate_on_every_rank(config: EngineConfig, prompt, params: SamplingParams, args) -> int:
    from specray.llm import LLM

    with LLM(config) as llm:
        is_printing = llm.rank == 0  # under torchrun every rank runs this; rank 0 speaks
        if is_printing:
            _print_geometry(llm)
        start = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        elapsed = time.perf_counter() - start
    if not is_printing:
        return 0
    if out.text or args.prompt is not None:
        print(out.text)
    if args.prompt_ids is not None:
        print("output ids:", ",".join(map(str, out.token_ids)))
    _print_stats(out, elapsed)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """One turn per input line, the conversation kept; ``/exit`` or end of input ends it."""
    from specray.async_llm import AsyncLLM
    from specray.executor.text import ChatPrompt
    from specray.launch import resolve_launcher
    from specray.terminal import stream_to_terminal

    config = engine_config_from_args(args)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens ({args.max_tokens}) must be >= 1 for specray chat")
    if resolve_launcher(config) == "external":
        raise ValueError("specray chat reads the terminal on one process; under torchrun use `specray generate` "
                         "or pass --launcher mp/ray")
    params = sampling_params_from_args(args, max_tokens=args.max_tokens, stop=tuple(args.stop))
    history = [{"role": "system", "content": args.system}] if args.system else []
    llm = AsyncLLM(config)
    try:
        _print_geometry(llm)
        print("type a message, /exit to quit", file=sys.stderr)
        for line in sys.stdin:
            line = line.rstrip("\n")
            if line.strip() == "/exit":
                break
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            start = time.perf_counter()
            out = stream_to_terminal(llm, ChatPrompt(list(history)), params)
            _print_stats(out, time.perf_counter() - start, file=sys.stderr)
            history.append({"role": "assistant", "content": out.text})
    finally:
        llm.close()
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from specray.serve.server import serve

    return serve(engine_config_from_args(args), args)


def run_bench(args: argparse.Namespace) -> int:
    from specray import bench as bench_lib
    from specray.llm import LLM
    from specray.models.loader import read_model_arch
    from specray.models.presets import resolve_model

    if args.same_text:
        from specray.same_text_cli import run_same_text

        return run_same_text(args, config_from_flags)
    config = engine_config_from_args(args)
    params = sampling_params_from_args(args)
    bench = bench_lib.BenchConfig(input_len=args.input_len, output_len=args.output_len,
                                  batch_sizes=tuple(args.batch_sizes), warmup=args.warmup, seed=args.seed or 0)
    vocab_size = read_model_arch(resolve_model(config.model, config.seed)).vocab_size
    with LLM(config) as llm:
        is_printing = llm.rank == 0  # under torchrun every rank runs this; rank 0 speaks
        if is_printing:
            _print_geometry(llm)
        rows = bench_lib.run_sweep(llm, bench, params, vocab_size, progress=is_printing and not args.no_progress)
        geometry = llm.geometry
    if not is_printing:
        return 0
    print(f"{config.model}: input {bench.input_len}, output {bench.output_len} tokens, "
          f"{config.dtype} on {config.device}, tp {config.parallel.tp_size}")
    print(bench_lib.format_table(rows))
    if args.json:
        path = bench_lib.write_json(args.json, engine_config=config, bench=bench, geometry=geometry, rows=rows)
        print(f"wrote {path}")
    if args.plot:
        from specray.bench_plot import plot_sweeps

        plain_rows, spec_rows = rows, None
        if config.spec.is_enabled:  # the plot compares against plain decoding: run it too
            plain_config = dataclasses.replace(config, spec=SpecConfig())
            with LLM(plain_config) as llm:
                plain_rows = bench_lib.run_sweep(llm, bench, params, vocab_size, progress=not args.no_progress)
            spec_rows = rows
        print(f"wrote {plot_sweeps(args.plot, plain_rows, spec_rows, title=config.model)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed "usage ... error: ..."
        return int(exit_.code or 0)
    try:
        return args.run(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
