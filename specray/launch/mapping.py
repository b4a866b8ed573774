"""Mapping validation: does this model split over these ranks? Checked before any process
group starts (on the driver, or on every torchrun process before it joins), from the
checkpoint's config.json alone, so a bad mapping costs no process and no weight load."""

from __future__ import annotations

from specray.config import ParallelConfig
from specray.models.arch import ModelArch


def validate_mapping(arch: ModelArch, parallel: ParallelConfig, world_size: int | None = None) -> None:
    """Raise ``ValueError`` naming the value and the rule for the first rule broken."""
    tp = parallel.tp_size
    moe_tp, moe_ep = parallel.resolved_moe_sizes
    world = tp if world_size is None else world_size
    rules = [
        (world == tp, f"world size ({world}) must equal tp_size ({tp}): there is no pipeline or data parallelism"),
        (arch.num_heads % tp == 0, f"tp_size ({tp}) must divide the attention heads ({arch.num_heads})"),
        (arch.num_kv_heads % tp == 0 or tp % arch.num_kv_heads == 0,
         f"kv heads ({arch.num_kv_heads}) must be divisible by tp_size ({tp}), or tp_size divisible by the "
         f"kv heads (then kv heads are replicated)"),
        (moe_tp * moe_ep == tp, f"moe_tp_size ({moe_tp}) * moe_ep_size ({moe_ep}) must equal tp_size ({tp})"),
    ]
    has_dense_mlp = len(arch.moe_layers) < arch.num_layers
    if has_dense_mlp:
        rules.append((arch.intermediate_size % tp == 0,
                      f"tp_size ({tp}) must divide the MLP intermediate size ({arch.intermediate_size})"))
    if arch.is_moe:
        rules += [
            (arch.num_experts % moe_ep == 0,
             f"moe_ep_size ({moe_ep}) must divide the number of experts ({arch.num_experts})"),
            (arch.moe_intermediate_size % moe_tp == 0,
             f"moe_tp_size ({moe_tp}) must divide the expert intermediate size ({arch.moe_intermediate_size})"),
        ]
        if arch.router is not None and arch.router.num_shared_experts:
            shared = arch.moe_intermediate_size * arch.router.num_shared_experts
            rules.append((shared % tp == 0, f"tp_size ({tp}) must divide the shared experts' intermediate size "
                                            f"({shared} = moe_intermediate_size x n_shared_experts)"))
        if arch.shared_expert_intermediate_size:
            rules.append((arch.shared_expert_intermediate_size % tp == 0,
                          f"tp_size ({tp}) must divide the shared expert's intermediate size "
                          f"({arch.shared_expert_intermediate_size})"))
    elif parallel.moe_ep_size not in (None, 1):
        rules.append((False, f"moe_ep_size ({parallel.moe_ep_size}) needs a mixture-of-experts model; "
                             f"{arch.architecture} has no experts"))
    if arch.linear is not None:  # Gated DeltaNet splits whole key-head groups (and their value heads)
        rules.append((arch.linear.num_k_heads % tp == 0,
                      f"tp_size ({tp}) must divide the linear-attention key heads ({arch.linear.num_k_heads})"))
    for ok, message in rules:
        if not ok:
            raise ValueError(f"{arch.architecture}: {message}")
