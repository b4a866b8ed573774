"""Engine configuration: frozen dataclasses, validated when built.

A bad value raises ``ConfigError`` (a ``ValueError`` and a ``SpecrayError``) whose message
names the value and the rule it broke, so the error surfaces at the call that built the
config, before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specray.errors import ConfigError

LAUNCHERS = ("auto", "local", "mp", "ray", "external")
ALLREDUCE_MODES = ("auto", "one_shot", "torch")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
SPEC_METHODS = ("draft_model", "dflash", "dspark", "eagle3", "mtp", "ngram")
STANDALONE_DRAFTERS = ("draft_model", "dflash", "dspark")
POOL_LESS_DRAFTERS = ("ngram",)  # draft from token ids alone: no weights, no KV
PROMPT_LOOKUP_DEFAULT = 5  # vLLM's default for both prompt_lookup_min and prompt_lookup_max
DTYPES = ("float32", "bfloat16", "float16")
MIN_TOKENS_PER_BLOCK, MAX_TOKENS_PER_BLOCK = 8, 256
MAX_LOGPROBS = 20  # the OpenAI API's bound on top_logprobs (and on completions' logprobs, 5 there)
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)  # a ValueError too


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """How the ranks are laid out and started."""

    tp_size: int = 1
    """Tensor-parallel ranks; also the world size (no pipeline or data parallelism)."""
    moe_tp_size: int | None = None
    """Ways each expert's matrices are split; defaults to tp_size / moe_ep_size."""
    moe_ep_size: int | None = None
    """Contiguous expert groups; defaults to 1."""
    launcher: str = "auto"
    """local | mp | ray | external; auto picks external under torchrun (or mpirun/Slurm: whenever RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set), local at tp 1, mp otherwise."""
    allreduce: str = "auto"
    """auto | one_shot | torch: which all-reduce the row-parallel layers use."""
    timeout_s: float = 60.0
    """Every collective and every wait on another rank gives up after this many seconds."""
    check_every_step: bool = False
    """Debug: compare every step's sampled tokens across ranks (one extra gather per step).
    Without it the ranks still compare a digest of all their tokens at the end of each call."""
    placement_strategy: str = "PACK"
    """ray: how the placement group (one bundle per rank) spreads over nodes: PACK (fewest nodes),
    SPREAD, STRICT_PACK (one node) or STRICT_SPREAD (one rank per node)."""
    placement_group: object | None = None
    """ray: a ready-made ``PlacementGroup`` with one bundle per rank, used as it is: specray
    neither changes nor removes it, and ``placement_strategy`` does not apply."""
    placement_timeout_s: float = 60.0
    """ray: how long to wait for the placement group's resources before failing with an error."""
    failure_timeout_s: float = 30.0
    """ray: a rank whose actor dies or stops answering fails the call within this many seconds."""
    ray_address: str | None = None
    """ray: the cluster to join (``host:port``, ``ray://host:port``, or ``"local"`` for a new local
    instance). None: RAY_ADDRESS, else the head in Ray's address file if it answers, else a new
    local instance (``specray.launch.ray_connect``)."""
    runtime_env: dict | None = None
    """ray: the rank actors' runtime_env (pip, working_dir, env_vars, ...); its env_vars add to
    the driver variables every rank receives (``specray.envs.forwarded_env``)."""

    def __post_init__(self) -> None:
        _require(self.tp_size >= 1, f"tp_size ({self.tp_size}) must be >= 1")
        _require(self.launcher in LAUNCHERS, f"launcher {self.launcher!r} must be one of {LAUNCHERS}")
        _require(self.allreduce in ALLREDUCE_MODES, f"allreduce {self.allreduce!r} must be one of {ALLREDUCE_MODES}")
        _require(self.timeout_s > 0, f"timeout_s ({self.timeout_s}) must be > 0")
        for name in ("moe_tp_size", "moe_ep_size"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"{name} ({value}) must be >= 1")
            _require(value is None or self.tp_size % value == 0,
                     f"{name} ({value}) must divide tp_size ({self.tp_size}): moe_tp_size * moe_ep_size == tp_size")
        tp, ep = self.resolved_moe_sizes
        _require(
            tp * ep == self.tp_size,
            f"moe_tp_size ({tp}) * moe_ep_size ({ep}) must equal tp_size ({self.tp_size})",
        )
        _require(self.launcher != "local" or self.tp_size == 1,
                 f"launcher 'local' runs one rank in this process, so tp_size ({self.tp_size}) must be 1")
        self._validate_ray_fields()

    def _validate_ray_fields(self) -> None:
        _require(self.placement_strategy in PLACEMENT_STRATEGIES,
                 f"placement_strategy {self.placement_strategy!r} must be one of {PLACEMENT_STRATEGIES}")
        for name in ("placement_timeout_s", "failure_timeout_s"):
            value = getattr(self, name)
            _require(value > 0, f"{name} ({value}) must be > 0")
        _require(self.placement_group is None or self.launcher in ("auto", "ray"),
                 f"placement_group is a Ray placement group, so launcher ({self.launcher!r}) must be 'ray' or 'auto'")
        _require(self.ray_address is None or (isinstance(self.ray_address, str) and self.ray_address.strip() != ""),
                 f"ray_address ({self.ray_address!r}) must be a non-empty address string or None")
        env = self.runtime_env
        _require(env is None or isinstance(env, dict), f"runtime_env ({env!r}) must be a dict or None")
        env_vars = (env or {}).get("env_vars", {})
        _require(isinstance(env_vars, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in env_vars.items()),
                 f"runtime_env['env_vars'] ({env_vars!r}) must map variable names to string values")

    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def resolved_moe_sizes(self) -> tuple[int, int]:
        """(moe_tp_size, moe_ep_size) with the defaults filled in."""
        ep = self.moe_ep_size or (self.tp_size // self.moe_tp_size if self.moe_tp_size else 1)
        tp = self.moe_tp_size or max(self.tp_size // ep, 1)
        return tp, ep


@dataclass(frozen=True, kw_only=True, slots=True)
class KVConfig:
    """Paged KV pools."""

    tokens_per_block: int = 16
    """Page size of the target pool: a power of two from 8 to 256."""
    capacity_tokens: int | None = None
    """Explicit token capacity per pool; when None the budget comes from free memory."""
    memory_fraction: float = 0.5
    """Fraction of the memory free after loading the weights that the KV pools may take."""
    cpu_max_bytes: int = 2 << 30
    """On CPU, never give the KV pools more than this, whatever the free memory."""
    enable_prefix_caching: bool = True
    """Share full pages of verified tokens between requests with the same prefix (every pool)."""

    def __post_init__(self) -> None:
        b = self.tokens_per_block
        _require(
            isinstance(b, int) and _is_power_of_two(b) and MIN_TOKENS_PER_BLOCK <= b <= MAX_TOKENS_PER_BLOCK,
            f"tokens_per_block ({b}) must be a power of two from {MIN_TOKENS_PER_BLOCK} to {MAX_TOKENS_PER_BLOCK}",
        )
        _require(self.capacity_tokens is None or self.capacity_tokens >= 1,
                 f"capacity_tokens ({self.capacity_tokens}) must be >= 1")
        _require(0.0 < self.memory_fraction <= 1.0, f"memory_fraction ({self.memory_fraction}) must be in (0, 1]")
        _require(self.cpu_max_bytes >= 1, f"cpu_max_bytes ({self.cpu_max_bytes}) must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecConfig:
    """Speculative decoding; method None means plain decoding."""

    method: str | None = None
    """draft_model | dflash | dspark | eagle3 | mtp | ngram, or None for plain decoding."""
    draft_model: str | None = None
    """Drafter checkpoint directory or preset; None picks the preset matching the target."""
    num_draft_tokens: int = 4
    """k: tokens drafted per verify step (ngram: at most k, fewer or none where nothing matches)."""
    force_accepted_tokens: float | None = None
    """Benchmarking only (changes outputs): accept this many drafts regardless of their value."""
    prompt_lookup_min: int | None = None
    """ngram: the shortest n-gram to match (vLLM's name). Unset: prompt_lookup_max if that is set,
    else 5 (vLLM's default)."""
    prompt_lookup_max: int | None = None
    """ngram: the longest n-gram to match; longer matches are tried first. Unset: prompt_lookup_min
    if that is set, else 5 (vLLM's default)."""
    prompt_lookup_spec_factor: float | None = None
    """ngram: draft at most floor(factor x the matched n-gram's length) tokens (and at most k), as
    SuffixDecoding scales its speculation with the match length (vLLM's
    ``suffix_decoding_max_spec_factor``): a 1-gram match is weak evidence, a 4-gram strong. None
    (the default, vLLM's ngram): up to k whatever the match."""

    dspark_confidence_threshold: float | None = None
    """dspark: stop a sequence's drafts early where its confidence head predicts they would be
    rejected: draft j is proposed only while the product of the predicted acceptance
    probabilities of drafts 0..j stays >= this threshold (in (0, 1)). None (the default):
    always k drafts."""
    adaptive: bool = False
    """Choose each request's draft length per step, from 0 to ``num_draft_tokens`` (the
    ceiling), by a step-cost model measured online and the request's own acceptance
    (docs/speculative.md, "Adaptive draft length"). False (the default until the benchmark
    grid says otherwise): every decoding request drafts ``num_draft_tokens`` every step."""
    adaptive_probe: bool = True
    """With ``adaptive``: time a short fixed schedule of steps on every rank at start-up and start
    the step-cost model from their fit (``executor/probe.py``; a few hundred ms on tiny models).
    False starts it from a fixed CPU guess (``adaptive.PRIOR_COST``) instead: for tests that must
    start fast."""

    def __post_init__(self) -> None:
        _require(isinstance(self.adaptive, bool), f"adaptive ({self.adaptive!r}) must be True or False")
        _require(isinstance(self.adaptive_probe, bool),
                 f"adaptive_probe ({self.adaptive_probe!r}) must be True or False")
        _require(not self.adaptive or self.method is not None,
                 "adaptive=True chooses a draft length per step and needs a spec method; set method or drop adaptive")
        _require(self.method is None or self.method in SPEC_METHODS,
                 f"spec method {self.method!r} must be one of {SPEC_METHODS} or None")
        _require(self.num_draft_tokens >= 1, f"num_draft_tokens ({self.num_draft_tokens}) must be >= 1")
        f = self.force_accepted_tokens
        k = self.num_draft_tokens
        _require(f is None or 1.0 <= f <= k + 1,
                 f"force_accepted_tokens ({f}) must be within [1, num_draft_tokens + 1 = {k + 1}]")
        self._resolve_prompt_lookup()
        c = self.dspark_confidence_threshold
        _require(c is None or self.method == "dspark", f"dspark_confidence_threshold ({c}) applies to spec method "
                 f"'dspark' only, not {self.method!r}: leave it unset")
        _require(c is None or (isinstance(c, (int, float)) and 0.0 < c < 1.0),
                 f"dspark_confidence_threshold ({c}) must be in (0, 1), or None to always draft k tokens")

    def _resolve_prompt_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            f = self.prompt_lookup_spec_factor
            _require(lo is None and hi is None and f is None, f"prompt_lookup_min ({lo}), prompt_lookup_max ({hi}) "
                     f"and prompt_lookup_spec_factor ({f}) apply to spec method 'ngram' only, not {self.method!r}: "
                     f"leave them unset")
            return
        _require(self.draft_model is None, f"spec method 'ngram' drafts from the sequence's own tokens: "
                 f"draft_model ({self.draft_model!r}) must be unset")
        # as vLLM: one bound given sets both, none gives both the default
        if lo is None and hi is None:
            lo = hi = PROMPT_LOOKUP_DEFAULT
        lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            _require(isinstance(value, int) and value >= 1, f"{name} ({value}) must be an integer >= 1")
        _require(lo <= hi, f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        f = self.prompt_lookup_spec_factor
        _require(f is None or (isinstance(f, (int, float)) and f > 0),
                 f"prompt_lookup_spec_factor ({f}) must be > 0, or None to draft up to k whatever the match")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @property
    def is_enabled(self) -> bool:
        return self.method is not None

    @property
    def is_standalone(self) -> bool:
        return self.method in STANDALONE_DRAFTERS


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on a request's output text, compiled by xgrammar on every rank.

    ``kind``: ``json_object`` (any JSON object; ``spec`` empty), ``json_schema`` (``spec``: the
    schema as JSON text), ``regex``, ``choice`` (``spec``: a JSON list of the allowed strings) or
    ``grammar`` (``spec``: EBNF in xgrammar's GBNF dialect, root rule ``root``)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        _require(self.kind in STRUCTURED_KINDS, f"structured output kind {self.kind!r} must be one of "
                                                f"{STRUCTURED_KINDS}")
        _require(isinstance(self.spec, str), f"structured output spec must be text, got {type(self.spec).__name__}")
        _require(bool(self.spec) or self.kind == "json_object",
                 f"structured output of kind {self.kind!r} needs a non-empty spec")


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Stop strings: the request ends when its text contains one, cut before it (a str or a list)."""
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    """Leave special tokens (EOS, chat markers) out of the output text."""
    logprobs: int | None = None
    """Log-probabilities of each output token and of the ``logprobs`` most likely tokens at its
    position (0: the chosen token's only); None: none are computed. They are the target model's
    raw log-softmax, before temperature, top-k, top-p and any grammar mask (vLLM's default)."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first (``RequestOutput.prompt_logprobs``)."""
    structured: StructuredOutput | None = None
    """A grammar every output token must keep the text inside (JSON, a regex, EBNF...)."""
    cache_salt: str | None = None
    """Prefix-cache isolation: pages are shared only between requests with the same salt."""

    def __post_init__(self) -> None:
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 0,
                 f"max_tokens ({self.max_tokens}) must be an integer >= 0 (0: run the prompt only, "
                 f"for its prompt_logprobs)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                     f"{name} ({value!r}) must be None or an integer in [0, {MAX_LOGPROBS}]")
        _require(self.structured is None or isinstance(self.structured, StructuredOutput),
                 f"structured ({self.structured!r}) must be None or a StructuredOutput")
        _require(self.structured is None or not self.ignore_eos,
                 "ignore_eos cannot go with structured output: the grammar ends the text with a stop token")
        _require(math.isfinite(self.temperature) and self.temperature >= 0,
                 f"temperature ({self.temperature}) must be >= 0 (0 means greedy)")
        _require(self.top_k >= 0, f"top_k ({self.top_k}) must be >= 0 (0 disables it)")
        _require(0.0 < self.top_p <= 1.0, f"top_p ({self.top_p}) must be in (0, 1]")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _require(all(isinstance(s, str) and s for s in stop),
                 f"stop ({self.stop!r}) must be a string or a list of non-empty strings")
        object.__setattr__(self, "stop", stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


# The CPU default token budget per step: the smallest budget whose prefill throughput is at least 0.8 of
# the best, so a long prompt's TTFT stays within 1.25x of one unchunked prefill (smollm2-135m, a
# 2048-token prompt; benchmarks/bench_chunk_size.py, docs/prefix-caching.md).
CPU_MAX_NUM_BATCHED_TOKENS = 256
GPU_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM's order of magnitude for a GPU; not measured here


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """Everything one LLM needs: the model, where it runs and how it decodes."""

    model: str = "tiny-llama"
    """A built-in preset (tiny-llama, tiny-qwen3, tiny-moe, tiny-deepseek-v3, tiny-kimi-k2, tiny-qwen3-next,
    mid-llama) or a Hugging Face checkpoint dir."""
    device: str = "cpu"
    dtype: str = "float32"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """None means the defaults, ``ParallelConfig()`` (likewise for kv and spec)."""
    kv: KVConfig = field(default_factory=KVConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    max_num_seqs: int = 64
    """Requests decoded together in one step."""
    max_num_batched_tokens: int | None = None
    """Tokens one step computes: decode and verify rows (1 + k each) first, prefill chunks fill the
    rest, so a long prompt is split into chunks and never stalls the decoding requests for long.
    None: ``CPU_MAX_NUM_BATCHED_TOKENS`` on CPU, ``GPU_MAX_NUM_BATCHED_TOKENS`` on CUDA."""
    seed: int = 0
    """Seeds the preset weights and the per-request seeds that are not given."""

    def __post_init__(self) -> None:
        for name, kind in (("parallel", ParallelConfig), ("kv", KVConfig), ("spec", SpecConfig)):
            value = getattr(self, name)
            if value is None:  # as if the field were left out: LLM(model=..., spec=None) reads naturally
                object.__setattr__(self, name, kind())
            _require(isinstance(getattr(self, name), kind),
                     f"{name} ({value!r}) must be a {kind.__name__} or None (the defaults)")
        _require(self.dtype in DTYPES, f"dtype {self.dtype!r} must be one of {DTYPES}")
        _require(self.device == "cpu" or self.device.startswith("cuda"),
                 f"device {self.device!r} must be 'cpu' or 'cuda'")
        _require(self.max_num_seqs >= 1, f"max_num_seqs ({self.max_num_seqs}) must be >= 1")
        _require(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= 1 (None: the device's default)")

    @property
    def step_token_budget(self) -> int:
        """``max_num_batched_tokens``, or the device's default when it is None."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CPU_MAX_NUM_BATCHED_TOKENS if self.device == "cpu" else GPU_MAX_NUM_BATCHED_TOKENS
