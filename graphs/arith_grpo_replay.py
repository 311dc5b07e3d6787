"""GRPO on synthetic arithmetic with experience replay: the main job plus ``ops.replay``.

1. ``dataset -> generate -> reward -> advantage``: as in ``graphs/arith_grpo.py`` (group-
   relative advantages; behavior log-probs and the policy version of every token kept).
2. ``replay``: each train step's batch gets ``replay.ratio`` of its rows from earlier steps'
   (``floor(r N / (1 - r))`` for ``N`` fresh rows), drawn from a buffer of
   ``replay.capacity`` already-trained rows; a row whose oldest token is more than k
   (``async.max_staleness``) versions older than the trainer is evicted, never trained.
3. ``train_step``: the decoupled PPO loss (on with k >= 1) weights every row, fresh or
   replayed, by ``pi_prox / pi_behav`` (capped) and clips against the proximal policy.
4. ``sync_weights``: the new version goes to the generator.

The fresh samples are trained exactly once; the replayed ones are logged apart (their
``meta["replayed_from_step"]`` in ``trajectories/trajectories.jsonl``, ``train/replay/*``
in the metrics).

Run: ``areal-flow run graphs/arith_grpo_replay.py`` (knobs in the YAML beside it).
"""

from areal_flow import Model, flow, ops


@flow
def arith_grpo_replay(cfg):
    policy = Model("policy", cfg.model)
    prompts = ops.dataset(cfg.dataset)
    rollout = ops.generate(policy, prompts, n_samples=cfg.gen.n_samples, max_new_tokens=cfg.gen.max_new_tokens,
                           temperature=cfg.gen.temperature, top_p=cfg.gen.top_p, engine=cfg.gen.engine)
    reward = ops.reward(rollout, fn="arithmetic")
    adv = ops.advantage(rollout, reward)
    mixed = ops.replay(adv, ratio=cfg.replay.ratio, capacity=cfg.replay.capacity)
    stats = ops.train_step(policy, mixed, algorithm=cfg.train.algorithm, max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats


if __name__ == "__main__":
    from areal_flow.cli import run_main

    raise SystemExit(run_main(arith_grpo_replay))
