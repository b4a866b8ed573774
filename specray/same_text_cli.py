"""`specray bench --same-text`: the command-line side of same_text.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def add_same_text_arguments(bench: argparse.ArgumentParser) -> None:
    g = bench.add_argument_group("same-text acceptance (--same-text)")
    g.add_argument("--same-text", action="store_true",
                   help="greedy --output-len tokens over fixed prefixes, plain and speculative: acceptance length "
                        "with a 95%% bootstrap interval, per-position acceptance, outputs equal to plain")
    g.add_argument("--prefixes", metavar="FILE.jsonl",
                   help="prefixes (prompt_ids, messages or prompt per line); default: HumanEval's prompts")
    g.add_argument("--num-prefixes", type=int, default=20, help="how many prefixes (default 20)")
    g.add_argument("--variant-a", default="", metavar="'NAME=VALUE ...'",
                   help="configuration a: the engine flags plus these (upper-case NAME: an environment variable, "
                        "e.g. SPECRAY_DRAFT_KERNEL_PAGE_SIZES=32; lower-case: a flag, e.g. num-draft-tokens=5)")
    g.add_argument("--variant-b", default=None, metavar="'NAME=VALUE ...'",
                   help="configuration b, compared with a prefix by prefix (paired)")


def run_same_text(args: argparse.Namespace, config_from_flags) -> int:
    """``config_from_flags(flags, args)``: the EngineConfig of the command line's engine flags with
    a variant's flags applied (the CLI provides it: this module does not import the CLI)."""
    from specray.config import SpecConfig
    from specray.models.presets import resolve_model
    from specray.models.tokenizer import load_tokenizer
    from specray import same_text as st

    variants = [st.parse_variant(args.variant_a)] + ([st.parse_variant(args.variant_b)]
                                                       if args.variant_b is not None else [])
    configs = [config_from_flags(list(v.flags), args) for v in variants]
    if not configs[0].spec.is_enabled:
        raise ValueError("--same-text compares speculative decoding with plain decoding: pass --spec METHOD")
    if configs[0].dtype != "float32":
        print(f"note: dtype {configs[0].dtype}: outputs equal to plain are guaranteed in float32 only")
    tokenizer = None
    if args.prefixes is None or not _all_token_ids(args.prefixes):
        tokenizer = load_tokenizer(resolve_model(configs[0].model, configs[0].seed))
    prefixes = st.load_prefixes(args.prefixes, args.num_prefixes, tokenizer)
    plain, _ = st.run_prefixes(dataclasses.replace(configs[0], spec=SpecConfig()), prefixes, args.output_len)
    reports = []
    for config, variant in zip(configs, variants):
        outputs, pages = st.run_prefixes(config, prefixes, args.output_len, variant.env)
        reports.append(dict(st.summarize(outputs, plain, seed=args.seed or 0), page_sizes=pages))
    print(f"{configs[0].model}: {len(prefixes)} prefixes, {args.output_len} greedy tokens each, batch 1")
    for name, variant, config, report in zip("ab", variants, configs, reports):
        label = f"{name} ({config.spec.method}, k={config.spec.num_draft_tokens}{', ' + variant.text if variant.text else ''})"
        print(st.format_report(label, report))
    result = {"variants": [v.text for v in variants], "reports": reports}
    if len(reports) == 2:
        result["comparison"] = st.compare(*reports, seed=args.seed or 0)
        print(st.format_comparison(result["comparison"]))
    if args.json:
        Path(args.json).write_text(json.dumps(st.to_json(result), indent=2))
        print(f"wrote {args.json}")
    return 0


def _all_token_ids(path: str) -> bool:
    """Whether every line of a prefixes file gives token ids (then no tokenizer is needed)."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    return bool(lines) and all("prompt_ids" in json.loads(line) for line in lines)
