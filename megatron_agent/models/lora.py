"""Low-rank adapters (LoRA) on Megatron's linear layers, at any TP/SP/PP/EP layout.

    add_lora(chunks, LoraConfig(rank=8), hf)   # base frozen; each targeted linear gains .lora
    with adapters_off(chunks): ...              # the base model (the KL reference)
    lora_sharded_state(chunks)                  # the adapters alone, for dist_checkpointing

A targeted linear computes W·x + (alpha/rank)·B·(A·x). A and B are split the way W is:
a column-parallel W (rows over TP: linear_qkv, linear_fc1) keeps A [r, in] whole and B's
rows split as W's are; a row-parallel W (columns over TP: linear_proj, linear_fc2) splits
A's columns and keeps B [out, r] whole. So on every rank the merged local weight is
W_local + scale·B_local·A_local, in W's own split (`merged_weight`), and the export and
the weight sync need nothing else (bridge.exported_parameters asks the adapter for it). The adapter runs beside the linear (a forward hook on
it) with the same communication as the base: the column case gathers or copies its input
into the TP region, the row case reduces its low-rank output as the base reduces its own.
Where each rank holds a part of the whole gradient of a whole (replicated) A or B, it is
summed over the linear's TP group in the backward (`_WeightGradSummed`).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from megatron_agent.models.bridge import EXPERT_INDEX, LAYER_INDEX

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
COLUMN_TARGETS = ("linear_qkv", "linear_fc1")


@dataclass
class LoraConfig:
    rank: int = 0  # 0: no adapters, every weight trains
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, in training
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    experts: bool = True  # the MoE experts' linear_fc1 / linear_fc2 too, when targeted

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        if self.rank < 0:
            raise ValueError(f"actor.lora.rank={self.rank} must be >= 0 (0: no adapters)")
        if not self.enabled:
            return
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"actor.lora.dropout={self.dropout} must be in [0, 1)")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"actor.lora.targets={list(self.targets)}: choose among {list(TARGETS)}")


class _WeightGradSummed(torch.autograd.Function):
    """x·wᵀ whose gradient for w is summed over `group` (each rank computed a part of the
    whole gradient of a w every rank holds whole), while x's gradient stays this rank's."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad_weight, group=ctx.group)
        return grad_x, grad_weight, None


class LoraAdapter(torch.nn.Module):
    """The A and B of one Megatron linear (`a` [r, in_local], `b` [out_local, r])."""

    def __init__(self, linear, config: LoraConfig, key: str, seed: int):
        from megatron.core.tensor_parallel.layers import (
            ColumnParallelLinear,
            set_tensor_model_parallel_attributes,
        )

        super().__init__()
        weight = linear.weight
        self.column = isinstance(linear, ColumnParallelLinear)
        self.group = linear.tp_group
        tp_rank, tp_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        # Experts: the token dispatcher moves tokens between ranks, not the linear.
        self.explicit_comm = linear.explicit_expert_comm
        self.sequence_parallel = linear.sequence_parallel and tp_size > 1
        self.scale, self.dropout, self.key, self.enabled = config.scale, config.dropout, key, True
        in_full = linear.input_size
        # A is drawn whole, from a stream of its own, then cut: the same adapter at any layout.
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        a_full = torch.empty(config.rank, in_full).uniform_(-1 / math.sqrt(in_full), 1 / math.sqrt(in_full),
                                                          generator=g)
        a = a_full if self.column else a_full.chunk(tp_size, dim=1)[tp_rank]
        self.a = torch.nn.Parameter(a.to(weight.dtype).to(weight.device).contiguous())
        self.b = torch.nn.Parameter(torch.zeros(weight.shape[0], config.rank, dtype=weight.dtype, device=weight.device))
        split = self.b if self.column else self.a
        set_tensor_model_parallel_attributes(split, True, 0 if self.column else 1, 1)
        whole = self.a if self.column else self.b
        set_tensor_model_parallel_attributes(whole, False, -1, 1)
        for p in (self.a, self.b):
            p.allreduce = getattr(weight, "allreduce", True)  # Megatron's mark of an expert-parallel param

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tpl

        group = self.group
        if self.column:
            if not self.explicit_comm:
                x = (tpl.gather_from_sequence_parallel_region(x, group=group) if self.sequence_parallel
                     else tpl.copy_to_tensor_model_parallel_region(x, group=group))
            x = self._dropout(x)  # whole on every TP rank: the default stream, the same mask
            h = _WeightGradSummed.apply(x, self.a, group)
            return torch.nn.functional.linear(h, self.b) * self.scale
        with tpl.get_cuda_rng_tracker().fork() if self.dropout and self.training else contextlib.nullcontext():
            x = self._dropout(x)  # this rank's columns: a stream per TP rank
        h = torch.nn.functional.linear(x, self.a)
        if self.explicit_comm:
            y = _WeightGradSummed.apply(h, self.b, group)
        elif self.sequence_parallel:
            y = _WeightGradSummed.apply(tpl.reduce_scatter_to_sequence_parallel_region(h, group=group), self.b, group)
        else:
            y = torch.nn.functional.linear(tpl.reduce_from_tensor_model_parallel_region(h, group=group), self.b)
        return y * self.scale

    def _dropout(self, x):
        return torch.nn.functional.dropout(x, self.dropout, self.training) if self.dropout else x

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's part of the linear's weight with the adapter merged in (the same split);
        the weight itself while the adapter is off."""
        return merge(weight.detach(), self.a.detach(), self.b.detach(), self.scale) if self.enabled else weight.detach()


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale·B·A, computed in fp32, in W's dtype."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


def _add_adapter_output(linear, args, output):
    out, bias = output
    if not linear.lora.enabled:
        return output
    return out + linear.lora(args[0]).to(out.dtype), bias


def _global_key(chunk, name: str) -> str:
    """The linear's name with global layer and expert indices: one key at any PP/EP layout."""
    from megatron.core import parallel_state as ps

    m = LAYER_INDEX.match(name)
    if m:
        layer = chunk.decoder.layers[int(m.group(1))].layer_number - 1
        name = LAYER_INDEX.sub(f"decoder.layers.{layer}.", name)
    e = EXPERT_INDEX.search(name)
    if e:
        experts_per_rank = chunk.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        expert = ps.get_expert_model_parallel_rank() * experts_per_rank + int(e.group(1))
        name = EXPERT_INDEX.sub(f".local_experts.{expert}.", name)
    return name


def targeted_linears(chunk, config: LoraConfig):
    """(name, module) of the linears `config` puts adapters on (the local layer spec's)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for name, module in chunk.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in config.targets or not name.startswith("decoder.layers."):
            continue
        if ".experts." in name and not config.experts:
            continue
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            raise NotImplementedError(
                f"actor.lora: {name} is a {type(module).__name__}; adapters are built on the local layer "
                "spec's ColumnParallelLinear / RowParallelLinear only (actor.layer_spec=local)")
        yield name, module


def add_lora(chunks: list, config: LoraConfig, *, seed: int = 0) -> int:
    """Freeze every parameter of `chunks` and put a trainable adapter on each targeted
    linear. Call after the base weights are loaded and before DDP and the optimizer see
    the parameters. Returns the number of this rank's adapter parameters."""
    count = 0
    for chunk in chunks:
        chunk.requires_grad_(False)
        for name, linear in list(targeted_linears(chunk, config)):
            linear.lora = LoraAdapter(linear, config, _global_key(chunk, name), seed)
            linear.register_forward_hook(_add_adapter_output)
            count += linear.lora.a.numel() + linear.lora.b.numel()
    if not count:
        raise ValueError(f"actor.lora: no linear of the model matches targets={list(config.targets)}"
                         f"{'' if config.experts else ' (experts excluded)'}")
    return count


def adapters(chunks: list):
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, LoraAdapter):
                yield module


@contextlib.contextmanager
def adapters_off(chunks: list):
    """The base model: every adapter of `chunks` adds nothing while inside."""
    switched = list(adapters(chunks))
    for a in switched:
        a.enabled = False
    try:
        yield
    finally:
        for a in switched:
            a.enabled = True


def lora_sharded_state(chunks: list) -> dict:
    """The adapters as dist_checkpointing tensors under layout-free keys ("lora.<global
    linear name>.a"), each the parameter itself (what the optimizer's state is matched by)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    state = {}
    for adapter in adapters(chunks):
        expert = ".local_experts." in adapter.key
        dp_group = (ps.get_expert_data_parallel_group() if expert
                    else ps.get_data_parallel_group(with_context_parallel=True))
        groups = dict(tp_group=adapter.group, dp_cp_group=dp_group)
        for param, split_axis in ((adapter.a, None if adapter.column else 1), (adapter.b, 0 if adapter.column else None)):
            key = f"lora.{adapter.key}.{'a' if param is adapter.a else 'b'}"
            if split_axis is None:
                state[key] = make_sharded_tensor_for_checkpoint(param, key, **groups)
                continue
            tensor = make_tp_sharded_tensor_for_checkpoint(param, key, split_axis, **groups)
            if param is adapter.b and adapter.key.endswith("linear_fc1"):  # rows [gate_r; up_r], as W's
                tensor = apply_swiglu_sharded_factory(tensor, ())
            state[key] = tensor
    return state


def lora_mismatch(checkpoint: str, saved: dict | None, lora: LoraConfig | None) -> str | None:
    """Why a checkpoint (its megatron_agent.json "lora": `saved`) does not resume into an
    actor with `lora` (None: no adapters); None when it does."""
    current = asdict(lora) if lora is not None and lora.enabled else None
    if saved == current:
        return None
    held = f"LoRA adapters {saved}" if saved else "a whole model (no LoRA)"
    wanted = f"actor.lora={current}" if current else "no adapters (actor.lora.rank=0)"
    return f"{checkpoint} holds {held}; this run has {wanted}: resume with the settings it was saved with"


def describe_trainable(trainable: int, model_parameters: int, lora: LoraConfig | None, params_dtype: str) -> str:
    """What trains and what Adam keeps for it: its two moments, plus an fp32 main copy of
    parameters kept in a 16-bit dtype."""
    state = trainable * (8 + (4 if params_dtype != "fp32" else 0))
    for unit in ("B", "kB", "MB", "GB"):
        if state < 1000 or unit == "GB":
            break
        state /= 1000
    what = f"LoRA rank {lora.rank} on {', '.join(lora.targets)}" if lora else "every weight"
    return (f"{trainable:,} trainable parameters ({what}) of a {model_parameters:,}-parameter model, "
            f"Adam state {state:.1f} {unit}")


# --- the adapters whole, as PEFT names them -------------------------------------------------


def whole_adapters(chunks: list, hf: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """{linear's TP=1 name (global layer and expert indices): (A, B)} of every adapter of
    the model, whole, on global rank 0 (None elsewhere). Every rank calls it: the split
    factor is gathered over the linear's TP group and unsplit as the weight is, then each
    TP-0, DP-0 rank's adapters (its stage's, its experts') go to rank 0."""
    from megatron.core import parallel_state as ps

    from megatron_agent.models.bridge import Bridge, all_gather_shards, unshard
    from megatron_agent.platform import control_group

    bridge, mine = Bridge(hf), {}
    for chunk in chunks:
        for name, module in chunk.named_modules():
            adapter = getattr(module, "lora", None)
            if not isinstance(adapter, LoraAdapter):
                continue
            split = bridge.mapping(chunk, f"{name}.weight").rule.split
            a, b = adapter.a.detach(), adapter.b.detach()
            if adapter.column:
                b = unshard(split, all_gather_shards(b, adapter.group))
            else:
                a = unshard(split, all_gather_shards(a, adapter.group))
            expert = ".local_experts." in adapter.key
            dp_rank = (ps.get_expert_data_parallel_rank() if expert
                       else ps.get_data_parallel_rank(with_context_parallel=True))
            if dist.get_rank(adapter.group) == 0 and dp_rank == 0:
                mine[adapter.key] = (a.cpu().clone(), b.cpu().clone())
    group = control_group()
    if dist.get_world_size(group) == 1:
        return mine
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    return {k: v for part in gathered for k, v in part.items()} if gathered is not None else None


def peft_tensors(hf: dict, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """PEFT's tensors (`base_model.model.<HF module>.lora_A.weight` [r, in], `lora_B` [out, r])
    for adapters on Megatron's fused linears (`whole_adapters`' keys): a fused linear's A
    goes to each HF module it is made of, and its B is cut into their rows by the bridge's
    own unfusing (q/k/v out of their query groups, gate and up). Experts come out one
    module per expert, the layout PEFT converts onto transformers' fused experts and
    SGLang reads; where HF itself keeps a layer's experts in one parameter (Qwen3-VL-MoE's
    gate_up_proj [E, 2I, H] and down_proj [E, H, I] in memory), as PEFT's LoRA on that
    parameter (`target_parameters`, `_fused_expert_factors`)."""
    from megatron_agent.models.bridge import Bridge, Dims, unfuse
    from megatron_agent.models.families.common import FUSED_EXPERTS

    bridge, dims = Bridge(hf), Dims.from_hf(hf, 1)
    out, fused = {}, {}
    for linear, (a, b) in sorted(adapters.items()):
        layer, expert = LAYER_INDEX.match(linear), EXPERT_INDEX.search(linear)
        template = EXPERT_INDEX.sub(".local_experts.{E}.", LAYER_INDEX.sub("decoder.layers.{L}.", linear)) + ".weight"
        rule = bridge.rules.get(template)
        if rule is None:
            raise ValueError(f"no PEFT module for {linear!r} ({hf['model_type']})")
        if rule.fuse == FUSED_EXPERTS:
            fused.setdefault(rule.hf[0].format(L=int(layer.group(1))), {})[int(expert.group(1))] = (a, b)
            continue
        modules = [name.format(L=int(layer.group(1)), E=int(expert.group(1)) if expert else None)
                   .removesuffix(".weight") for name in rule.hf]
        for module, b_part in zip(modules, unfuse(rule.fuse, b, dims)):
            out[f"base_model.model.{module}.lora_A.weight"] = a.clone()  # one A per module, as PEFT keeps it
            out[f"base_model.model.{module}.lora_B.weight"] = b_part.contiguous()
    for parameter, experts in fused.items():
        out.update(_fused_expert_factors(parameter, experts, fused))
    return out


def _fused_expert_factors(parameter: str, experts: dict[int, tuple], fused: dict) -> dict[str, torch.Tensor]:
    """PEFT's LoRA on one layer's fused expert parameter (peft's ParamWrapper): lora_A
    [E·r, in] holds the experts' A one after another, lora_B [out, r·E] their B with the
    expert index fastest (column k·E + e is expert e's column k), so that expert e's
    update is B_e·A_e. PEFT wraps the experts module once per targeted parameter, the
    first of `target_parameters` (gate_up_proj, `peft_config`) innermost: its tensors sit
    under `base_layer` when down_proj is targeted too."""
    if sorted(experts) != list(range(len(experts))):
        raise ValueError(f"{parameter}: adapters of experts {sorted(experts)}, not of all of them")
    a = torch.cat([experts[e][0] for e in range(len(experts))])
    b = torch.stack([experts[e][1] for e in range(len(experts))], dim=2).flatten(1)
    module, name = parameter.rsplit(".", 1)
    inner = name == "gate_up_proj" and f"{module}.down_proj" in fused
    prefix = f"base_model.model.{module}{'.base_layer' if inner else ''}"
    return {f"{prefix}.lora_A.weight": a.contiguous(), f"{prefix}.lora_B.weight": b.contiguous()}


def _targeted_rules(hf: dict, lora: LoraConfig):
    """The bridge's rules of the decoder's linears `lora` targets."""
    from megatron_agent.models.bridge import Bridge

    for rule in Bridge(hf).rules.values():
        leaf = rule.mcore.removesuffix(".weight").rsplit(".", 1)[-1]
        if (rule.mcore.startswith("decoder.layers.") and leaf in lora.targets
                and (lora.experts or ".local_experts." not in rule.mcore)):
            yield rule


def hf_module_names(hf: dict, lora: LoraConfig) -> tuple[str, ...]:
    """The HF modules' leaf names the adapters sit on (PEFT's and SGLang's target modules)."""
    return _leaf_names(_targeted_rules(hf, lora))


def _leaf_names(rules) -> tuple[str, ...]:
    return tuple(sorted({name.removesuffix(".weight").rsplit(".", 1)[-1] for rule in rules for name in rule.hf}))


def adapter_serving_problem(hf: dict, lora: LoraConfig) -> str | None:
    """Why engines cannot load these adapters (None: they can): SGLang and the embedded
    engine take LoRA on modules, and a model whose HF experts are one parameter per layer
    has its experts' adapters on parameters (`peft_tensors`)."""
    from megatron_agent.models.families.common import FUSED_EXPERTS

    if any(rule.fuse == FUSED_EXPERTS for rule in _targeted_rules(hf, lora)):
        return (f"{hf['model_type']} keeps its experts fused in HF, whose adapters the engines do not load "
                "(set actor.lora.experts=false to leave the experts out)")
    return None


def peft_config(hf: dict, lora: LoraConfig, base_model: str | None) -> dict:
    """The adapter_config.json of `peft_tensors`: target_modules are the HF modules' leaf
    names, target_parameters a fused-experts model's expert parameters (gate_up_proj first)."""
    from megatron_agent.models.families.common import FUSED_EXPERTS

    rules = list(_targeted_rules(hf, lora))
    modules = list(_leaf_names(rule for rule in rules if rule.fuse != FUSED_EXPERTS))
    fused = _leaf_names(rule for rule in rules if rule.fuse == FUSED_EXPERTS)
    parameters = [f"mlp.experts.{leaf}" for leaf in sorted(fused, key=lambda leaf: leaf != "gate_up_proj")]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": modules or None, "bias": "none", "use_rslora": False,
            "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": base_model,
            **({"target_parameters": parameters} if parameters else {})}


def write_peft_dir(out_dir, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors), written whole or not at all."""
    import json

    from safetensors.torch import save_file

    from megatron_agent.models.checkpoint import atomic_directory

    with atomic_directory(out_dir) as tmp:
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
