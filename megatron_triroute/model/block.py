"""The thin block: one pipeline stage's TriRoute layers, the routing state threaded through them.

    x, state = layer(x, inputs, state)   for each layer of the stage

Megatron's TransformerBlock builds the layers (and the final norm) from the spec and owns their
checkpoint description; this function replaces only its forward loop, whose fixed layer
signature has no place for the routing state. Full activation recompute follows Megatron's
`recompute_method` ("uniform": every chunk of `recompute_num_layers` layers; "block": the first
`recompute_num_layers` layers) with Megatron's own `tensor_parallel.checkpoint`, which saves the
chunk's input tensors (hidden states, routing inputs and state) and reruns it in backward. The
rerun is exact: the routing noise is a function of (seed, step, layer, sample, position).
"""

from __future__ import annotations

from typing import Sequence

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig

from ..routing.state import RoutingInputs, RoutingState
from .layer import finish_routing


def run_layers(layers: Sequence[torch.nn.Module], x: torch.Tensor, inputs: RoutingInputs, state: RoutingState,
               rotary_pos_emb: torch.Tensor | None, config: TransformerConfig,
               training: bool) -> tuple[torch.Tensor, RoutingState]:
    """Run `layers` in order; with full recompute (training only) through Megatron's checkpoint."""
    if config.recompute_granularity != "full" or not training:
        return _run(layers, x, inputs, state, rotary_pos_emb)
    n, chunk = len(layers), config.recompute_num_layers
    if config.recompute_method == "uniform":
        spans = [(i, min(i + chunk, n), True) for i in range(0, n, chunk)]
    elif config.recompute_method == "block":
        spans = [(i, i + 1, i < chunk) for i in range(n)]
    else:
        raise ValueError(f"recompute_method={config.recompute_method!r}: use 'uniform' or 'block'")
    for start, end, recompute in spans:
        if recompute:
            x, state = _checkpointed(layers[start:end], x, inputs, state, rotary_pos_emb,
                                     config.distribute_saved_activations)
        else:
            x, state = _run(layers[start:end], x, inputs, state, rotary_pos_emb)
    return x, state


def _run(layers, x, inputs, state, rotary_pos_emb):
    """The layers in order; in training their routing losses and statistics computed once for all
    of them, the losses attached to the last output (inside a recomputed chunk: its own layers')."""
    deferred: list | None = [] if layers and layers[0].training else None
    for layer in layers:
        x, state = layer(hidden_states=x, inputs=inputs, state=state, rotary_pos_emb=rotary_pos_emb,
                         deferred=deferred)
    if deferred:
        x = finish_routing(x, layers[0], deferred, inputs)
    return x, state


def _checkpointed(layers, x, inputs, state, rotary_pos_emb, distribute_saved_activations: bool):
    """`_run` under Megatron's activation checkpoint, which takes and returns flat tensors."""
    leader, reward = state.leader is not None, state.reward is not None

    def forward(x, psi, sample_index, rotary_pos_emb, *state_tensors):
        out_x, out_state = _run(layers, x, RoutingInputs(psi, sample_index),
                                RoutingState.from_tensors(state_tensors, leader, reward), rotary_pos_emb)
        return (out_x, *out_state.tensors())

    out = tensor_parallel.checkpoint(forward, distribute_saved_activations, x, inputs.psi, inputs.sample_index,
                                     rotary_pos_emb, *state.tensors())
    return out[0], RoutingState.from_tensors(out[1:], leader, reward)
