"""Check a parallel strategy against a ``transformers`` model config, in the parent process.

Reads the model's shape from its config (layers, heads, KV heads, experts) and
applies :meth:`ParallelStrategy.validate_for`, plus the rules that only the
runtime's own choices impose:

- context parallelism is Ulysses all-to-all (see ``context_parallel``), so
  ``cp`` must divide the heads and the KV heads left on each TP rank (the rule
  ``ulysses-heads`` of ``compiler.executable``, the one predicate).

Tied word embeddings are fine under ``pp > 1``: the first and last stages each keep a copy and
sum its gradients (``pipeline.sync_tied_embedding_grads``).
"""

from __future__ import annotations

from typing import Any

from compiler.executable import NodeFacts, ulysses_heads
from compiler.strategy import ParallelStrategy, StrategyError


def model_shape(config: Any) -> dict[str, int]:
    """Layers, heads, KV heads and routed experts of a Llama/Qwen2/Qwen3-MoE/Mixtral config.

    Returns:
        ``{"n_layers", "n_heads", "n_kv_heads", "n_experts"}`` (``n_experts`` is 0 for dense models).
    """
    n_heads = config.num_attention_heads
    return {
        "n_layers": config.num_hidden_layers,
        "n_heads": n_heads,
        "n_kv_heads": getattr(config, "num_key_value_heads", None) or n_heads,
        "n_experts": getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0,
    }


def validate_strategy_for_model(strategy: ParallelStrategy, config: Any, gpus_per_node: int | None = None) -> None:
    """Raise before any process starts if ``strategy`` cannot run ``config``.

    Raises:
        StrategyError: naming the broken rule (the strategy module's rules, or
            the Ulysses head rule above).
    """
    shape = model_shape(config)
    strategy.validate_for(**shape, gpus_per_node=gpus_per_node)
    why = ulysses_heads(NodeFacts("", "training", strategy, shape=shape))
    if why is not None:
        raise StrategyError(why)
