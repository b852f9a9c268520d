"""The PPO critic: the policy's transformer with a scalar value head, trained on its own.

    critic = Critic(model_dir, parallel, ActorConfig(...), AlgorithmConfig(...))
    values = critic.compute_values(batch)        # [N]: V(state) of each step sample
    metrics = critic.update(batch, returns)      # clipped value loss toward GAE targets

V(state) is read at the last prompt token (the state the action is generated from),
one value per step sample, the layout `algorithms.gae_advantages` takes. The backbone
starts from the HF checkpoint; the head starts at zero. The head is a plain linear
layer replicated over TP ranks (hidden states are whole on every TP rank), so the
optimizer counts it once.
"""

from __future__ import annotations

import torch

from megatron_agent.algorithms import value_loss
from megatron_agent.models.bridge import load_hf_weights
from megatron_agent.models.builder import build_model
from megatron_agent.training.actor import Actor
from megatron_agent.training.batch import TrainBatch
from megatron_agent.training.schedule import run_schedule


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel's output layer: hidden [s, b, h] -> values [s, b, 1].

    With sequence parallelism the hidden states arrive cut along the sequence over TP
    ranks; they are gathered first (as the output layer would), and in backward each
    rank keeps its own slice of the gradient (every rank computed the same values and
    loss, so nothing is summed)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


class Critic(Actor):
    """Same model building, optimizer, schedule and checkpoints as the actor."""

    REPLAYS_ROUTING = False  # a value model routes by its own weights
    HAS_REFERENCE = False  # no KL term on values

    def _build_chunks(self, build: dict) -> list:
        hf = dict(self.hf, tie_word_embeddings=False)  # the head is its own parameter
        chunks = build_model(hf, self.parallel, **build)
        for chunk in chunks:
            if chunk.post_process:
                chunk.output_layer = ValueHead(hf["hidden_size"], build["params_dtype"],
                                               sequence_parallel=self.parallel.sequence_parallel)
        load_hf_weights(chunks, self.model_dir, skip=lambda name: name.startswith("output_layer."))
        return chunks

    def named_hf_weights(self):
        raise RuntimeError("the critic has no HF counterpart to export")

    @staticmethod
    def _state_positions(mb) -> torch.Tensor:
        """The last prompt token: the first position whose target is a response token."""
        return mb["response_mask"].float().argmax(dim=-1)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """V(state) per sample: [N] on every rank for a whole batch, the shard's rows for a shard."""
        shard = self._shard(batch)
        values = {}

        def keep(mb, out):
            v = out[..., 0].float()
            picked = v.gather(1, self._state_positions(mb).unsqueeze(1))[:, 0]
            for k, i in enumerate(mb["index"].tolist()):
                values[i] = picked[k].detach().reshape(1).cpu()
            return v.sum() * 0.0, {}

        for chunk in self.model:
            chunk.eval()
        with torch.no_grad():
            if micro := self._forward_micro_batches(shard):
                run_schedule(self.model, micro, keep, forward_only=True)
        return self._gather_per_token(values, shard, batch, per_token=False)[:, 0]

    def update(self, batch: TrainBatch, returns: torch.Tensor | None = None,
               old_values: torch.Tensor | None = None) -> dict[str, float]:
        """Epochs over mini-batches of the clipped value loss toward `returns` (one per row
        of `batch`, like `old_values`)."""
        if returns is None:
            raise ValueError("the critic's update needs returns (GAE value targets)")
        shard = self._shard(batch)

        def rows(values):
            values = torch.as_tensor(values, dtype=torch.float32)
            return values if batch.is_shard else values[shard.positions()]

        self._returns = rows(returns)
        self._old_values = self.compute_values(shard) if old_values is None else rows(old_values)
        return super().update(shard)

    def _prepare_update(self, batch: TrainBatch) -> None:
        pass  # no advantages, reference model or old logprobs: returns and old values are set

    def _loss(self, batch: TrainBatch, mb, out, denominator: float):
        v = out[..., 0].float().gather(1, self._state_positions(mb).unsqueeze(1))[:, 0]
        idx = mb["index"]
        mask = (mb["response_mask"].sum(-1) > 0).float()
        loss, metrics = value_loss(v, self._old_values[idx], self._returns[idx], mask,
                                   clip_range=self.algorithm.value_clip, global_denominator=denominator)
        return loss, {f"critic/{k}": float(val) for k, val in metrics.items()}

    def _count(self, response_mask: torch.Tensor) -> float:
        return float((response_mask.sum(-1) > 0).sum())  # one value per sequence
