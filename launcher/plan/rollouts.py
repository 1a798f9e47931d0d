"""What online RL's sampling (objective=grpo, rloo) adds to a rank's memory: the rollouts' key-value cache.

Each step a rank samples train.micro_batch_size x train.grad_accum_steps completions in one batch
(launcher.rank.rollouts), so its key-value cache holds, for every decoder layer, keys and values of
that many rows of up to data.seq_len tokens, in the parameters' dtype (generation runs outside the
training autocast). It lives while sampling, before the step's forwards; the planner adds it to the
step's peak, which over-counts by whichever of the two is smaller. The reference (objective.beta > 0)
is counted as DPO's is (launcher.plan.preference), from the frozen model the objective declares.
"""

from __future__ import annotations

from launcher.components.model.shape import model_shape
from launcher.config.objective import ONLINE
from launcher.spec import RunSpec


def kv_width(spec: RunSpec) -> int:
    """Features of one token's keys plus values in one decoder layer (grouped-query attention counted as built)."""
    linears = model_shape(spec.model).block_linears
    width = sum(out for name, (_, out) in linears.items() if name.endswith(("k_proj", "v_proj")))
    return width or 2 * model_shape(spec.model).equivalent.d_model


def rollout_cache(spec: RunSpec) -> tuple[int, str] | None:
    """The key-value cache of one step's rollouts on a rank (None: not an online objective)."""
    if spec.objective.name not in ONLINE:
        return None
    rows = spec.train.micro_batch_size * spec.train.grad_accum_steps
    layers = model_shape(spec.model).equivalent.n_layer
    dtype_bytes = 2 if spec.precision.param_dtype in ("bf16", "fp16") else 4
    size = rows * spec.data.seq_len * layers * kv_width(spec) * dtype_bytes
    return size, (
        f"rollouts' key-value cache: {rows} rows x {spec.data.seq_len} tokens x {layers} layers x "
        f"{kv_width(spec)} key/value features x {dtype_bytes} B (while sampling)"
    )
