"""Exact resume with resampled slots (issue 26): DAPO's dynamic sampling drops groups and
gives their slots new prompts (``runtime.spares``, ``runtime.router``); a ``k = 0`` run
resumed from a checkpoint trains the same prompts, samples and weights as the uninterrupted
one, even when the checkpoints after its resume point are torn (skipped, said in one line).
The run helpers are test_resume's."""

from __future__ import annotations

import json
import shutil

import pytest

from runs import records
from test_resume import B, N, _cli, _finish, _same, _weights

STEPS, CUT = 4, 2
# seed 3: slot 3 is resampled 5 times at step 1 (before the checkpoint), slot 6 twice at step 3 (after it)
DAPO = ("async.max_staleness=0", f"train.steps={STEPS}", "train.checkpoint_every=1", "reward.max_attempts=40", "seed=3",
        "train.keep_checkpoints=3")


@pytest.mark.slow
def test_a_dapo_run_resumed_after_resampling_trains_what_the_uninterrupted_one_trains(tmp_path, warm_cache):
    _finish(_cli(tmp_path, "whole", *DAPO, graph="graphs/arith_dapo.py"))
    whole = tmp_path / "whole"
    trained = records(whole)
    assert len(trained) == STEPS * B * N
    attempts = {r["group_id"]: r["meta"]["attempt"] for r in trained}
    assert max(attempts[i] for i in range(CUT * B)) > 1  # slots resampled before the checkpoint ...
    assert max(attempts[i] for i in range(CUT * B, STEPS * B)) > 1  # ... and after it
    checkpoints = whole / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["version_2", "version_3", "version_4"]  # keep 3
    # a copy whose checkpoints after step CUT are torn (a truncated file, a flipped byte) and whose final
    # model is gone: the run continues from version_CUT, the folders it skips said one line each
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "model")
    weights = cut / "checkpoints/version_4/model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:-1])
    state = cut / "checkpoints/version_3/trainer_state.pt"
    data = state.read_bytes()
    state.write_bytes(data[:100] + bytes([data[100] ^ 0x10]) + data[101:])
    err = _finish(_cli(tmp_path, "cut", *DAPO, "--resume", str(cut), graph="graphs/arith_dapo.py"))
    assert [line for line in err.splitlines() if "skipping checkpoint" in line] == [
        f"areal-flow: skipping checkpoint {cut}/checkpoints/version_4: model.safetensors is {size - 1} bytes, the "
        f"manifest says {size}; falling back to the one before",
        f"areal-flow: skipping checkpoint {cut}/checkpoints/version_3: trainer_state.pt fails its xxh64 checksum; "
        "falling back to the one before"]
    assert f"resuming {cut} from version_{CUT} (step {CUT} of {STEPS})" in err
    assert records(cut) == trained  # every slot's prompt (problem_id, attempt), sample and log-prob, in order
    assert _same(_weights(cut / "model"), _weights(whole / "model"))  # bit-identical weights
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["version_2", "version_3", "version_4"]
    for v in (3, 4):  # written again over the torn ones, as the uninterrupted run wrote them
        assert _same(_weights(cut / f"checkpoints/version_{v}"), _weights(checkpoints / f"version_{v}"))
    router = json.loads((cut / "summary.json").read_text())["workers"]["router"]
    # the resumed attempt's drops, one per retry of its slots
    assert router["resampled"] == sum(attempts[i] - 1 for i in range(CUT * B, STEPS * B))


def test_at_k0_a_rounds_replacements_go_out_together_once_none_is_pending():
    """``runtime.router``: k = 0, B = 3: groups 0 and 2 dropped while 1 is on its way to the
    trainer; their replacements (attempt 2, prompts by slot) leave in one message, index order,
    only once the trainer has 1. At k = 1 a replacement leaves at once."""
    import threading

    from runtime.channels import MessageReceiver, MessageSender, ipc_address
    from runtime.router import Router

    key = b"rounds-test-secret"
    for k in (0, 1):
        replica, control = MessageReceiver(ipc_address("replica"), secret=key), ipc_address("control")
        router = Router([{"q": i} for i in range(3)], lambda i, a: {"q": f"{i}/{a}"}, k, 3, [replica.address],
                        control, secret=key)
        stop = threading.Event()
        thread = threading.Thread(target=router.run, args=(stop,))
        thread.start()
        to_router = MessageSender(control, secret=key)
        try:
            to_router.send(("ready", 0, 0))
            assert [i for i, _, _ in replica.recv(timeout_s=30.0)[1]] == [0, 1, 2]
            for msg in (("dropped", 0, 2, 1), ("sent", 0, 1, 1), ("dropped", 0, 0, 1)):
                to_router.send(msg)
            if k == 0:
                assert replica.recv(timeout_s=0.5) is None  # group 1 is not at the trainer yet
                to_router.send(("received", 1, 1))
                assert replica.recv(timeout_s=30.0)[1] == [(0, 2, {"q": "0/2"}), (2, 2, {"q": "2/2"})]
            else:
                got = []
                while len(got) < 2:
                    got += replica.recv(timeout_s=30.0)[1]
                assert got == [(2, 2, {"q": "2/2"}), (0, 2, {"q": "0/2"})]  # as the drops arrived, 1 still pending
        finally:
            stop.set()
            thread.join(timeout=30.0)
            to_router.close()
            replica.close()
