"""The one executability predicate: can the runtime run this node under this strategy?

Owns the rules of what the runtime (``runtime.parallel_trainer``, ``runtime.topology``,
the embedded generation engine) can run, beyond the model-shape rules of
``compiler.strategy.ParallelStrategy.validate_for``. Three callers ask the same question:

* the search (``compiler.cost.CostModel.strategies``): a strategy failing a rule is never
  enumerated, so ``compile`` never recommends it;
* a user's allocation or pin (``CostModel.check``, from ``compiler.allocation.resolve``):
  refused with the rule's name;
* the runtime, on the finished plan, before any process starts (:func:`check_executable`,
  from ``runtime.preflight.check_runnable``: once without shapes as the run is set up, again
  with the shapes of the prepared models' ``config.json``).

Each rule is a small function of one node's :class:`NodeFacts` returning why it fails (or
None), listed by name in :data:`TRAINING_RULES` / :data:`GENERATION_RULES`; which degrees a
critic's trainer or each generation engine may use is data (:data:`CRITIC_PARALLEL`,
:data:`ENGINE_PARALLEL`), so widening what the runtime runs is a one-line edit. It imports
no runtime module and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from compiler.strategy import ParallelStrategy, StrategyError

DEGREES = ("dp", "tp", "pp", "cp", "ep")
CRITIC_PARALLEL: tuple[str, ...] = ("dp", "tp", "cp", "pp", "ep")
"""Degrees a critic's (value model's) train_step may use above 1 (and their products, within the
other rules and :data:`CRITIC_APART`), on the ranks of the policy's train_step with its
strategy (``runtime.parallel_critic``; ``compiler.hosting``'s rule ``critic-ranks``) or on ranks
of its own mesh (``runtime.trainer_ranks``); the search proposes the first only (``compiler.choose``)."""
CRITIC_APART: tuple[tuple[str, str], ...] = (("pp", "tp"), ("pp", "cp"), ("ep", "pp"), ("ep", "tp"), ("ep", "cp"))
"""Pairs of degrees a critic's train_step cannot use together above 1 (``runtime.parallel_critic``
reads them too): its pipeline stages are FSDP-sharded over ``dp`` only, its experts split over
``dp`` ranks only."""
ENGINE_PARALLEL: dict[str, tuple[str, ...]] = {"embedded": ("dp",), "vllm": ("dp", "tp")}
"""Degrees each generation engine may use above 1: the embedded engine runs dN replicas of one
process each; vLLM adds tensor parallelism inside a replica."""
ACCUMULATION_KEY = "train.gradient_accumulation_steps"
"""The config key that fixes a train_step's micro-batches per DP rank exactly (its node attribute
``gradient_accumulation_steps``; 0 = the compiler chooses)."""


class ExecutableError(StrategyError):
    """A strategy the runtime cannot run; the message names the node and the broken rule."""


@dataclass(frozen=True)
class NodeFacts:
    """What the rules read of one device node.

    Attributes:
        node: its name. role: ``generation``, ``training`` or ``inference``.
        strategy: its parallel strategy.
        shape: ``{"n_layers", "n_heads", "n_kv_heads", "n_experts"}`` of its model; None = unknown
            (the rules that need it are skipped).
        critic: it trains a scalar-head (value) model. rows: sequences per optimizer step (B x samples).
        engine: a generation node's engine (``attrs["engine"]``). token_budget: its
        ``max_tokens_per_micro_batch`` (0 = off). accumulation: its ``gradient_accumulation_steps``
        (0 = the compiler chooses the micro-batches).
    """

    node: str
    role: str
    strategy: ParallelStrategy
    shape: dict | None = None
    critic: bool = False
    rows: int = 1
    engine: str = "embedded"
    token_budget: int = 0
    accumulation: int = 0

    @classmethod
    def from_attrs(cls, node: str, role: str, strategy: ParallelStrategy, attrs: dict, **kw) -> "NodeFacts":
        """Facts with ``engine``, ``token_budget`` and ``accumulation`` read from a node's attributes."""
        return cls(node, role, strategy, engine=attrs.get("engine") or "embedded",
                   token_budget=attrs.get("max_tokens_per_micro_batch") or 0,
                   accumulation=attrs.get("gradient_accumulation_steps") or 0, **kw)


def ulysses_heads(f: NodeFacts) -> str | None:
    """Why ``cp`` cannot scatter the heads left on each TP rank (Ulysses all-to-all), or None."""
    s = f.strategy
    if f.shape is None or s.cp == 1:
        return None
    heads, kv = f.shape["n_heads"] // s.tp, f.shape["n_kv_heads"] // s.tp
    if heads % s.cp or kv % s.cp:
        return (f"cp={s.cp} must divide the heads ({heads}) and KV heads ({kv}) per TP rank: Ulysses context "
                "parallelism scatters heads across the cp ranks")
    return None


def _ep_without_pp_cp(f: NodeFacts) -> str | None:
    s = f.strategy
    if s.ep > 1 and (s.pp > 1 or s.cp > 1):
        return (f"ep={s.ep} with pp or cp: the RL trainer's expert parallelism runs over dp ranks, with or without "
                "tp (e.g. train:d2e2, train:d2t2e2)")
    return None


def _cp_without_pp(f: NodeFacts) -> str | None:
    s = f.strategy
    if s.cp > 1 and s.pp > 1:
        return (f"cp={s.cp} with pp={s.pp}: the RL trainer's context parallelism (sequence chunks, whole-row loss) "
                "runs with dp and tp, not inside a pipeline schedule")
    return None


def _rows_divide_dp(f: NodeFacts) -> str | None:
    if f.rows % f.strategy.dp:
        return (f"a step of {f.rows} sequences (train.batch_size x gen.n_samples) must divide by dp={f.strategy.dp}: "
                "every DP rank runs as many micro-batches (FSDP collectives) as the others")
    return None


def _rows_fill_pp(f: NodeFacts) -> str | None:
    per_rank, pp = f.rows // f.strategy.dp, f.strategy.pp
    if per_rank < pp:
        return (f"{per_rank} sequences per DP rank cannot fill pp={pp} pipeline micro-batches (the 1F1B schedule "
                "runs at least one micro-batch of at least one sequence per stage); raise train.batch_size")
    return None


def _token_budget_pp(f: NodeFacts) -> str | None:
    if f.token_budget and f.strategy.pp > 1:
        return (f"train.max_tokens_per_micro_batch={f.token_budget} with pp={f.strategy.pp}: pipeline stages "
                "exchange micro-batches of one shape; set it to 0 and size micro-batches with train.micro_batch_size")
    return None


def _critic_degrees(f: NodeFacts) -> str | None:
    if not f.critic:
        return None
    over = [d for d in DEGREES if getattr(f.strategy, d) > 1 and d not in CRITIC_PARALLEL]
    if over:
        allowed = ", ".join(CRITIC_PARALLEL) or "none: it runs on one process (e.g. train:d1)"
        return f"a critic's train_step cannot use {', '.join(over)} (allowed above 1: {allowed})"
    both = next((pair for pair in CRITIC_APART if all(getattr(f.strategy, d) > 1 for d in pair)), None)
    if both:
        return (f"a critic's train_step cannot use {both[0]} with {both[1]} (its pipeline stages and its experts "
                "run with dp only, e.g. critic_step:d2p2, critic_step:d2e2)")
    return None


def _accumulation_divides(f: NodeFacts) -> str | None:
    per_rank, m = f.rows // f.strategy.dp, f.accumulation
    if m and (per_rank < m or per_rank % m):
        return (f"{ACCUMULATION_KEY}={m} must divide the {per_rank} sequences per DP rank (a step of {f.rows} over "
                f"dp={f.strategy.dp}): every micro-batch holds the same number of sequences")
    return None


def _engine_degrees(f: NodeFacts) -> str | None:
    allowed = ENGINE_PARALLEL.get(f.engine, ("dp",))
    over = [d for d in DEGREES if getattr(f.strategy, d) > 1 and d not in allowed]
    if over:
        hint = "; tensor parallel generation needs engine='vllm'" if over == ["tp"] else ""
        return f"the {f.engine} generation engine runs only {'/'.join(allowed)}, not {', '.join(over)}{hint}"
    return None


Rule = Callable[[NodeFacts], "str | None"]
TRAINING_RULES: tuple[tuple[str, Rule], ...] = (
    ("ulysses-heads", ulysses_heads), ("ep-without-pp-cp", _ep_without_pp_cp), ("cp-without-pp", _cp_without_pp),
    ("rows-divide-dp", _rows_divide_dp), ("rows-fill-pp", _rows_fill_pp), ("token-budget-no-pp", _token_budget_pp),
    ("critic-parallel", _critic_degrees), ("accumulation-divides-rows", _accumulation_divides),
)
"""Rules of a node that trains its model, in the order they are tried."""
GENERATION_RULES: tuple[tuple[str, Rule], ...] = (("engine-parallel", _engine_degrees),)
"""Rules of a generation node. Forward-only nodes have none: on a multi-rank mesh they run on rank 0."""


def failed_rule(facts: NodeFacts) -> tuple[str, str] | None:
    """``(rule name, why)`` of the first rule ``facts`` breaks, or None when the runtime can run it."""
    rules = {"training": TRAINING_RULES, "generation": GENERATION_RULES}.get(facts.role, ())
    for name, rule in rules:
        why = rule(facts)
        if why is not None:
            return name, why
    return None


def check_node(facts: NodeFacts) -> None:
    """Raise if the runtime cannot run this node under its strategy.

    Raises:
        ExecutableError: ``node '<name>' strategy <s>: rule '<rule>': <why>``.
    """
    failed = failed_rule(facts)
    if failed is not None:
        raise ExecutableError(f"node '{facts.node}' strategy {facts.strategy.short()}: rule '{failed[0]}': {failed[1]}")


def check_executable(plan, shapes: dict[str, dict] | None = None, rows: int | None = None) -> None:
    """Check every device node of ``plan`` (a ``compiler.plan.Plan``) with :func:`check_node`.

    Args:
        shapes: model name -> its shape (``NodeFacts.shape``); None or a missing model = the
            shape rules are skipped for its nodes.
        rows: sequences per optimizer step; default the plan's ``workload["n_sequences"]``.

    Raises:
        ExecutableError: the first node breaking a rule (see :func:`check_node`).
    """
    shapes = shapes or {}
    rows = rows if rows is not None else int(plan.workload["n_sequences"])
    for node in plan.nodes:
        if node.strategy is None:
            continue
        head = plan.models.get(node.model, {}).get("head", "lm")
        check_node(NodeFacts.from_attrs(node.name, node.role, ParallelStrategy.parse(node.strategy), node.attrs,
                                        shape=shapes.get(node.model), critic=node.trains and head != "lm",
                                        rows=rows))
