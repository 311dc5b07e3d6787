"""GRPO on synthetic arithmetic with a tiny Mixture-of-Experts policy, its experts split
over the trainer's ranks (expert parallelism).

The algorithm is ``arith_grpo``'s; the policy is ``tiny-moe`` (Qwen3-MoE shape: every layer
routes each token to 2 of 8 SwiGLU experts, ~1.8 M parameters, ~0.6 M active per token),
and the yaml gives the train_step the strategy ``d2e2``: 2 data-parallel ranks, each holding
4 of every layer's 8 experts (GShard, Lepikhin et al. 2020, sec. 2.2). Each rank routes its
half of the batch with the (replicated) router, sends every token to the rank of its chosen
experts and back by all-to-all, and the rest of the model is sharded by FSDP over the same
2 ranks (``runtime.parallel.expert_parallel``); the generator, in a third process, runs the
whole model.

1. ``dataset -> generate`` (``blocks.sample_groups``): a group of ``gen.n_samples``
   responses per arithmetic prompt.
2. ``reward``: 1 for an exactly right answer, else 0.
3. ``advantage``: group-relative, ``(r - mean) / (std + eps)``.
4. ``train_step``: algorithm ``grpo`` (PPO clip, token-mean over the whole step).
5. ``sync_weights``: the experts are gathered from both ranks and the new version goes to
   the generator.

Run: ``areal-flow run graphs/arith_grpo_moe.py`` (3 CPU processes: ``cluster.n_gpus_per_node=3``).
"""

from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy


@flow
def arith_grpo_moe(cfg):
    policy = Model("policy", cfg.model)
    rollout = sample_groups(policy, cfg)
    reward = ops.reward(rollout, fn="arithmetic")
    adv = ops.advantage(rollout, reward, estimator="grpo")
    return train_policy(policy, adv, rollout, cfg, algorithm="grpo")


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_grpo_moe))
