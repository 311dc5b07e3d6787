"""Atomic, verified weight updates (``runtime.weight_set``, ``runtime.weights``, the embedded
engine's ``update_weights``): a corrupted bucket, a wrong shape or a missing tensor never
reaches the engine's weights; the version stays, the error is counted and names the culprit.
"""

from __future__ import annotations

import pytest
import torch

from runtime.channels import ipc_address
from runtime.weight_set import TensorSetError, check_tensor_set, differences, tensor_set
from runtime.weight_subscriber import WeightChecksumError, WeightSubscriber
from runtime.weights import WeightPublisher

KEY = b"k" * 32


@pytest.fixture
def engine(tmp_path):
    from test_reliability import _random_tiny

    from runtime.engines.generation import GenerationEngine

    model, tok = _random_tiny(tmp_path)
    return GenerationEngine(model, tok, max_batch_size=2)


@pytest.fixture
def channel():
    made = []

    def make(**kw):
        sub = WeightSubscriber(ipc_address("w"), secret=KEY)
        # 1 MiB buckets: the tiny model's ~4 MB of weights make a few, within the queues' high-water marks
        pub = WeightPublisher(sub.address, secret=KEY, linger_s=0, bucket_bytes=1 << 20, **kw)
        made.extend([pub, sub])
        return pub, sub

    yield make
    for end in made:
        end.close()


def _copy(engine) -> dict[str, torch.Tensor]:
    """A copy of the engine's model weights (or of a module's)."""
    model = getattr(engine, "model", engine)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _shifted(state: dict, by: float) -> dict:
    return {k: v + by if v.is_floating_point() else v.clone() for k, v in state.items()}


def test_differences_name_every_kind():
    expected = tensor_set({"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(1, dtype=torch.int64)})
    got = {"a": torch.zeros(3, 2), "c": torch.zeros(1, dtype=torch.int32), "z": torch.zeros(1)}
    assert differences(expected, got) == ["missing 'b'", "unexpected 'z'", "shape of 'a' [3, 2] (expected [2, 3])",
                                          "dtype of 'c' int32 (expected int64)"]
    assert differences(expected, got, dtypes=False)[-1] == "shape of 'a' [3, 2] (expected [2, 3])"
    check_tensor_set(expected, {"a": torch.ones(2, 3), "b": torch.ones(4), "c": torch.ones(1, dtype=torch.int64)},
                     "same")  # equal sets pass


def test_a_wrong_shape_leaves_the_engine_untouched(engine):
    before = _copy(engine)
    name = next(k for k, v in before.items() if v.dim() == 2 and v.shape[0] != v.shape[1])
    bad = _shifted(before, 1.0)
    bad[name] = bad[name].t().contiguous()  # right numel, wrong shape
    # the control: torch's own strict load copies every other tensor before it reports the shape
    probe = {k: v.clone() for k, v in before.items()}
    victim = type(engine.model)(engine.model.config)
    victim.load_state_dict(probe)
    with pytest.raises(RuntimeError):
        victim.load_state_dict(bad, strict=True)
    assert not _same(_copy(victim), before)  # mixed weights without the check
    with pytest.raises(TensorSetError, match=rf"update_weights to version 3: tensor set differs: shape of '{name}'"):
        engine.update_weights(bad, 3)
    assert _same(_copy(engine), before) and engine.version == 0 and engine.refused_updates == 1
    missing = _shifted(before, 1.0)
    del missing[name]
    with pytest.raises(TensorSetError, match=rf"missing '{name}'"):
        engine.update_weights(missing, 3)
    assert _same(_copy(engine), before) and engine.version == 0 and engine.refused_updates == 2
    engine.update_weights(_shifted(before, 1.0), 3)  # a good version still loads
    assert _same(_copy(engine), _shifted(before, 1.0)) and engine.version == 3


def test_a_corrupted_bucket_never_reaches_the_engine(engine, channel):
    def flip(header, payload):
        if header["version"] == 2 and header["bucket"] == 1:
            payload[0] ^= 0xFF

    pub, sub = channel(tamper=flip)
    v1 = _shifted(_copy(engine), 0.5)
    pub.publish(v1, version=1)
    engine.update_weights(*reversed(sub.wait(1, timeout_s=5)))
    pub.publish(_shifted(v1, 0.5), version=2)
    with pytest.raises(WeightChecksumError, match="weight version 2, bucket 1/"):
        sub.wait(2, timeout_s=5)
    assert sub.checksum_errors == 1 and sub.version == 1
    assert _same(_copy(engine), v1) and engine.version == 1


def test_a_version_with_another_tensor_set_is_discarded_and_counted(engine, channel):
    pub, sub = channel()
    v1 = _shifted(_copy(engine), 0.5)
    pub.publish(v1, version=1)
    engine.update_weights(*reversed(sub.wait(1, timeout_s=5)))
    name = next(k for k, v in v1.items() if v.dim() == 2)
    v2 = _shifted(v1, 0.5)
    v2[name] = v2[name].to(torch.bfloat16)  # a publisher that changed a dtype
    pub.publish(v2, version=2)
    with pytest.raises(TensorSetError, match=rf"weight version 2 on .*: tensor set differs: dtype of '{name}' "
                                             r"bfloat16 \(expected float32\); version 2 discarded, keeping version 1"):
        sub.wait(2, timeout_s=5)
    assert sub.set_errors == 1 and sub.version == 1 and _same(sub.state_dict, v1)
    assert _same(_copy(engine), v1) and engine.version == 1
    v3 = _shifted(v1, 1.0)
    pub.publish(v3, version=3)  # the channel goes on with the next good version
    engine.update_weights(*reversed(sub.wait(3, timeout_s=5)))
    assert _same(_copy(engine), v3) and engine.version == 3
