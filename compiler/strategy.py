"""The parallel strategy of one graph node: degrees of DP, TP, PP, CP and EP.

Owns the one validated object that both the compiler (which chooses it) and the
runtime (which applies it with ``torch.distributed``) read, in the manner of
torchtitan's ``ParallelDims``. It must not know about meshes of real devices or
about processes: ``runtime.parallel`` builds those from it.

Validation rules (each error names the rule it breaks):

- every degree is a positive integer;
- ``world_size == dp * tp * pp * cp`` (EP re-uses the DP x CP ranks, as in
  torchtitan, so it does not multiply the world size);
- ``tp`` divides the number of attention heads and of KV heads (for generation engines,
  which replicate KV heads, it may instead be a multiple of the KV heads);
- ``tp`` stays inside one node (``tp <= gpus_per_node``), since its per-layer
  all-reduces need the intra-node link;
- ``pp`` divides the number of layers;
- ``ep > 1`` only for a Mixture-of-Experts model, and ``ep`` divides both the
  number of experts and ``dp * cp``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LETTERS = {"d": "dp", "t": "tp", "p": "pp", "c": "cp", "e": "ep"}


class StrategyError(ValueError):
    """A parallel strategy breaks one of the rules of the model or cluster."""


@dataclass(frozen=True)
class ParallelStrategy:
    """Degrees of parallelism of one node.

    Attributes:
        dp: data-parallel degree (FSDP/ZeRO shards over it when enabled).
        tp: tensor-parallel degree (Megatron column/row split of each layer).
        pp: pipeline-parallel degree (contiguous blocks of layers per stage).
        cp: context (sequence) parallel degree (the sequence is split).
        ep: expert-parallel degree (experts of a MoE layer split); uses DP x CP ranks.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StrategyError(f"{name}={value!r}: every parallel degree must be an integer >= 1")
        if (self.dp * self.cp) % self.ep != 0:
            raise StrategyError(
                f"ep={self.ep} must divide dp*cp={self.dp * self.cp}: expert parallelism re-uses the data/context ranks"
            )

    @property
    def world_size(self) -> int:
        """Number of devices (GPUs or CPU processes) this strategy occupies."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def validate_for(
        self,
        *,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        n_experts: int = 0,
        gpus_per_node: int | None = None,
        replicate_kv: bool = False,
    ) -> None:
        """Check this strategy against a model's shape and the node size.

        Args:
            replicate_kv: an inference engine (vLLM, SGLang) replicates KV heads when
                ``tp`` exceeds them, so ``tp`` need only be a multiple of the KV heads.

        Raises:
            StrategyError: naming the first rule broken (see the module docstring).
        """
        kv_ok = n_kv_heads % self.tp == 0 or (replicate_kv and self.tp % n_kv_heads == 0)
        if n_heads % self.tp or not kv_ok:
            kv = f"divide or be a multiple of the KV heads ({n_kv_heads})" if replicate_kv else f"KV heads ({n_kv_heads})"
            raise StrategyError(f"tp={self.tp} must divide the attention heads ({n_heads}) and {kv}")
        if gpus_per_node is not None and self.tp > gpus_per_node:
            raise StrategyError(f"tp={self.tp} must stay inside one node of {gpus_per_node} devices")
        if n_layers % self.pp:
            raise StrategyError(f"pp={self.pp} must divide the number of layers ({n_layers})")
        if self.ep > 1 and n_experts == 0:
            raise StrategyError(f"ep={self.ep} needs a Mixture-of-Experts model; this model is dense")
        if self.ep > 1 and n_experts % self.ep:
            raise StrategyError(f"ep={self.ep} must divide the number of experts ({n_experts})")

    def short(self) -> str:
        """Compact form used in allocation strings: ``d2t4p1`` drops degrees of 1 except dp."""
        parts = [f"d{self.dp}"]
        for letter, name in (("t", "tp"), ("p", "pp"), ("c", "cp"), ("e", "ep")):
            if getattr(self, name) > 1:
                parts.append(f"{letter}{getattr(self, name)}")
        return "".join(parts)

    @classmethod
    def parse(cls, text: str) -> "ParallelStrategy":
        """Parse the compact form, e.g. ``"d4t2"`` or ``"d2t2p2e2"``.

        Raises:
            StrategyError: with the offending character position.
        """
        degrees: dict[str, int] = {}
        pos = 0
        for match in re.finditer(r"([a-z])(\d+)|(.)", text):
            if match.group(3) is not None or match.group(1) not in _LETTERS:
                raise StrategyError(
                    f"bad strategy {text!r} at character {match.start() + 1}: expected one of "
                    f"d/t/p/c/e followed by a number\n  {text}\n  {' ' * match.start()}^"
                )
            name = _LETTERS[match.group(1)]
            if name in degrees:
                raise StrategyError(f"bad strategy {text!r} at character {match.start() + 1}: {name} given twice")
            degrees[name] = int(match.group(2))
            pos = match.end()
        if pos == 0:
            raise StrategyError(f"empty strategy {text!r}: expected e.g. 'd4t2'")
        return cls(**degrees)
