"""Declared interfaces (``areal_flow.ops.interfaces``): every engine and every built-in executor
satisfies its protocol, checked with ``isinstance`` on real instances and by comparing each
method's parameters with the protocol's, so the workers call them without ``hasattr`` probing.

* ``Engine``: the embedded ``GenerationEngine`` and ``VLLMEngine`` (built over a stand-in
  ``vllm`` module: the real one is not installed in this venv);
* ``StreamExecutor``: the generate and rollout executors;
* ``Executor``: the group and batch executors (filter, reward, logprobs, advantage, a user
  op's function), all built as ``cls(node, ctx)``; ``Trainer``: the train executor.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Protocol

import pytest

from areal_flow.models.tiny import build_model
from areal_flow.models.tokenizer import build_char_tokenizer
from areal_flow.ops import OPS
from areal_flow.ops.interfaces import Engine, Executor, StreamExecutor, Trainer
from areal_flow.ops.function import FunctionExecutor
from areal_flow.ops.registry import BATCH, GROUP, STREAM
from runtime.engines.generation import GenerationEngine

REPO = Path(__file__).resolve().parents[1]
TOK = build_char_tokenizer()
TINY = ["train.steps=2", "train.batch_size=2", "gen.n_samples=2", "warm_start.steps=10", "eval.enabled=false"]


def _members(proto: type) -> tuple[set[str], set[str]]:
    """``(methods, other members)`` a protocol declares, its protocol bases' included."""
    methods, others = set(), set()
    for base in proto.__mro__:
        if base is Protocol or not getattr(base, "_is_protocol", False):
            continue
        for name, value in vars(base).items():
            if name.startswith("_"):
                continue
            (methods if inspect.isfunction(value) else others).add(name)
        others |= {n for n in getattr(base, "__annotations__", {}) if not n.startswith("_")}
    return methods, others - methods


def _check(cls: type, proto: type) -> None:
    """Every method of ``proto`` is a method of ``cls`` with the same parameters (names and
    order); every property of ``proto`` is a property of ``cls``."""
    methods, others = _members(proto)
    for name in methods:
        want = list(inspect.signature(getattr(proto, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}{got} is not {proto.__name__}.{name}{want}"
    for name in others:
        if isinstance(vars(proto).get(name), property):
            assert isinstance(inspect.getattr_static(cls, name), property), f"{cls.__name__}.{name} is no property"


def test_the_check_fails_for_a_class_that_differs():
    class Lacks:
        def run(self, inputs):  # one parameter short
            return inputs

    with pytest.raises(AssertionError, match=r"Lacks.run\['self', 'inputs'\] is not Executor.run"):
        _check(Lacks, Executor)
    assert not isinstance(Lacks(), Executor)  # no ``node``


def _vllm_stand_in(monkeypatch) -> None:
    """A ``vllm`` module with the two names ``VLLMEngine.__init__`` imports (no engine runs)."""
    class LLMEngine:
        model_config = SimpleNamespace(max_model_len=64)

        @classmethod
        def from_engine_args(cls, args):
            return cls()

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(EngineArgs=lambda **kwargs: kwargs, LLMEngine=LLMEngine))


def test_both_engines_are_engines(monkeypatch, tmp_path):
    from runtime.engines.vllm_engine import VLLMEngine

    embedded = GenerationEngine(build_model("tiny-s", len(TOK)), TOK, max_batch_size=2)
    _vllm_stand_in(monkeypatch)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    vllm = VLLMEngine(tmp_path, TOK, max_batch_size=2, dtype="bfloat16")
    for engine in (embedded, vllm):
        assert isinstance(engine, Engine)
        _check(type(engine), Engine)
    assert (str(vllm.dtype), vllm.dtype_speedup) == ("torch.bfloat16", None)  # the summary's engine_dtype
    vllm.reseed(3)  # its stream is fixed at start: nothing to do, nothing raised
    embedded.submit(_request())
    embedded.close()
    assert not embedded.has_work()  # closed: nothing in flight


def _request():
    from runtime.engines.generation import GenerationRequest, SamplingParams

    return GenerationRequest("r0", TOK.encode("1+1="), SamplingParams(max_new_tokens=2))


def _engine(monkeypatch, module):
    engine = GenerationEngine(build_model("tiny-s", len(TOK)), TOK, max_batch_size=2)
    monkeypatch.setattr(module, "build_engine", lambda node, ctx: engine)
    return engine


def test_generate_and_rollout_executors_are_stream_executors(monkeypatch, tmp_path):
    import runtime.executors.generate as generate
    import runtime.executors.rollout as rollout

    sampling = {"n_samples": 2, "max_new_tokens": 2, "temperature": 1.0, "top_p": 1.0, "chat_template": False}
    ctx = SimpleNamespace(tokenizer=TOK, folders={"policy": "unused"}, out_dir=str(tmp_path))
    _engine(monkeypatch, generate)
    gen = generate.GenerateExecutor(SimpleNamespace(attrs=sampling, name="generate", model="policy"), ctx)
    _engine(monkeypatch, rollout)
    attrs = {**sampling, "env": "guess_number", "max_turns": 2, "gamma": 1.0, "max_context": 64}
    episodes = rollout.RolloutExecutor(SimpleNamespace(attrs=attrs, name="rollout", model="policy"), ctx)
    for executor in (gen, episodes):
        assert isinstance(executor, StreamExecutor)
        _check(type(executor), StreamExecutor)
        executor.close()
    assert gen.occupancy() == {"rows": 0, "slots": 2} and episodes.occupancy() == {}  # no engine step yet


def _context(tmp_path):
    """A worker context over the arith_grpo plan whose policy is a tiny random model (no folder read)."""
    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config
    from compiler.program import compile_program
    from runtime.context import WorkerContext

    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, f"out_dir={tmp_path}"])
    plan = compile_program(load_flow(REPO / "graphs/arith_grpo.py")(cfg), cfg)
    ctx = WorkerContext(plan, {"policy": str(tmp_path / "policy")}, tmp_path)
    ctx.models["policy"], ctx._tokenizer = build_model("tiny-s", len(TOK)), TOK
    return ctx


def test_group_and_batch_executors_are_executors_built_from_node_and_ctx(tmp_path):
    from areal_flow.ops.filter import FilterExecutor
    from areal_flow.ops.logprobs import LogprobsExecutor
    from areal_flow.ops.reward import RewardExecutor
    from runtime.executors.advantage import AdvantageExecutor
    from runtime.executors.train import TrainStepExecutor

    from areal_flow.ops.registry import register_op

    register_op("iface_user_op", inputs={"rollouts": "rollouts"}, outputs={"rollouts": "rollouts"})(
        lambda rollouts: rollouts)
    ctx = _context(tmp_path)
    frozen = SimpleNamespace(name="ref_logprobs", model="policy", attrs={"temperature": 1.0})
    built = [FilterExecutor(SimpleNamespace(name="filter", attrs={"max_attempts": 2}), ctx),
             RewardExecutor(ctx.node("reward"), ctx), LogprobsExecutor(frozen, ctx),
             AdvantageExecutor(ctx.node("advantage"), ctx), TrainStepExecutor(ctx.node("train_step"), ctx),
             FunctionExecutor(lambda rollouts: rollouts, SimpleNamespace(name="user", op="iface_user_op", attrs={},
                                                                         source="t.py:1"), ctx)]
    for executor in built:
        assert isinstance(executor, Executor), type(executor).__name__
        _check(type(executor), Executor)
    trainer = built[4]
    assert isinstance(trainer, Trainer) and not isinstance(built[3], Trainer)
    _check(TrainStepExecutor, Trainer)
    assert trainer.port == "advantages" and trainer.world_size == 1


def test_every_built_in_executor_is_constructed_from_node_and_ctx():
    kinds = {STREAM: StreamExecutor, GROUP: Executor, BATCH: Executor}
    checked = set()
    for op in OPS.values():
        if op.grain not in kinds or not op.builtin:
            continue
        cls = op.load_executor()
        assert list(inspect.signature(cls).parameters) == ["node", "ctx"], op.name
        _check(cls, Trainer if op.spec.trains else kinds[op.grain])
        checked.add(op.name)
    assert checked >= {"generate", "rollout", "reward", "filter", "logprobs", "advantage", "train_step"}


def test_gen_vllm_compile_reaches_vllm_engine_args(monkeypatch, tmp_path):
    """``gen.vllm_compile`` is lowered onto the generator and ``build_engine`` turns it into
    vLLM's ``enforce_eager=False``; ``threads_bind`` runs the worker in its own process, pinned."""
    import argparse
    import os

    from areal_flow.cli import flow_config, load_flow
    from compiler.program import lower_attrs
    from runtime.engines.vllm_engine import VLLMEngine
    from runtime.executors.generate import build_engine

    seen = []

    class LLMEngine:
        model_config = SimpleNamespace(max_model_len=64)

        @classmethod
        def from_engine_args(cls, args):
            seen.append(args)
            return cls()

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(EngineArgs=lambda **kwargs: kwargs, LLMEngine=LLMEngine))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    flow = load_flow(REPO / "graphs/arith_grpo.py")
    cfg = flow_config(flow, argparse.Namespace(config=None, overrides=["gen.engine=vllm", "gen.vllm_compile=true"]))
    graph = flow(cfg)
    lower_attrs(graph, cfg)
    node = next(n for n in graph.nodes.values() if n.op == "generate")
    assert node.attrs["vllm_compile"] is True
    import areal_flow.dtypes
    from runtime.context import WorkerContext

    import runtime.engines.precision

    monkeypatch.setattr(areal_flow.dtypes, "cpu_has_bf16", lambda cpuinfo=None: True)  # an AMX / AVX-512 BF16 CPU
    monkeypatch.setattr(runtime.engines.precision, "autocast_bf16_speedup", lambda: 3.0)  # bf16 products as on AMX
    plan = SimpleNamespace(run={"dtype": "auto", "seed": 0}, device_type="cpu")
    ctx = WorkerContext(plan, {node.model: str(tmp_path)}, tmp_path, _tokenizer=TOK)
    node.attrs["engine"] = "vllm"
    build_engine(SimpleNamespace(attrs=node.attrs, model=node.model, concurrent=None), ctx)  # the plan's node
    assert seen[-1]["enforce_eager"] is False and "distributed_executor_backend" not in seen[-1]
    assert seen[-1]["dtype"] == "bfloat16"  # model.dtype=auto as this worker resolved it for its CPU
    VLLMEngine(tmp_path, TOK, max_batch_size=2, threads_bind="0")  # eager by default
    assert seen[-1]["enforce_eager"] is True and seen[-1]["distributed_executor_backend"] == "mp"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"
