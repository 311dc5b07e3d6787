"""The embedded generation engine: KV cache, log-probs, continuous batching, weight updates."""

import math

import pytest
import torch

from areal_flow.models.logprobs import token_logprobs
from areal_flow.models.tiny import build_model
from areal_flow.models.tokenizer import build_char_tokenizer
from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams

torch.set_num_threads(1)
TOK = build_char_tokenizer()
PROMPTS = ["7=", "12+5=", "305-47=", "9+999=", "1-1="]


def _model(seed: int):
    """tiny-s re-initialised with large weights so greedy outputs vary from token to token."""
    model = build_model("tiny-s", len(TOK), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def _full_recompute_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding that reruns the whole sequence every step (no cache, no padding)."""
    ids = list(ids)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:] if n else []


def _spy_prefill(engine) -> list:
    """Record (sequences, tokens, starts) of every prefill call the engine makes, in order."""
    fed = []
    real = engine._dec.prefill

    def spy(seqs, rows, starts=None):
        fed.append((len(seqs), sum(map(len, seqs)), starts))
        return real(seqs, rows, starts)

    engine._dec.prefill = spy
    return fed


def _req(i, prompt, **params):
    params.setdefault("stop_at_eos", False)
    return GenerationRequest(f"r{i}", TOK.encode(prompt), SamplingParams(**params), meta={"i": i})


def test_kv_cache_greedy_equals_full_recompute():
    model = _model(0)
    engine = GenerationEngine(model, TOK, max_batch_size=8)
    results = engine.generate([_req(i, p, temperature=0.0, max_new_tokens=12) for i, p in enumerate(PROMPTS)])
    for r in results:
        assert r.output_ids == _full_recompute_greedy(model, r.prompt_ids, 12)
        assert r.finish_reason == "length" and r.versions == [0] * 12 and r.meta == {"i": int(r.request_id[1:])}
    assert len({t for r in results for t in r.output_ids}) > 5  # outputs are not degenerate


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_behavior_logprobs_match_recomputation(top_p):
    model = _model(1)
    engine = GenerationEngine(model, TOK, max_batch_size=8, seed=3)
    temp = 0.7
    results = engine.generate([_req(i, p, temperature=temp, top_p=top_p, max_new_tokens=10) for i, p in enumerate(PROMPTS)])
    seqs = [r.prompt_ids + r.output_ids for r in results]
    width = max(map(len, seqs))
    # left-padded batch, prompts of 3..8 tokens
    ids = torch.tensor([[TOK.pad_token_id] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    with torch.no_grad():
        ref = token_logprobs(model, ids, mask, temperature=temp)
    for b, r in enumerate(results):
        n = len(r.output_ids)
        diff = (ref[b, width - n:] - torch.tensor(r.behavior_logprobs)).abs().max().item()
        assert diff < 1e-4


def test_tiny_top_p_is_greedy_and_temperature_sampling_follows_softmax():
    model = _model(2)
    engine = GenerationEngine(model, TOK, max_batch_size=4)
    greedy = engine.generate([_req(0, "12+5=", temperature=0.0, max_new_tokens=8)])[0]
    # top_p -> 0 keeps only the most likely token: nucleus sampling collapses to argmax
    nucleus = engine.generate([_req(0, "12+5=", temperature=1.0, top_p=1e-6, max_new_tokens=8)])[0]
    assert nucleus.output_ids == greedy.output_ids

    # 4000 one-token samples at temperature 2: empirical frequency of the top token vs softmax(logits / 2)
    engine = GenerationEngine(model, TOK, max_batch_size=4000, seed=5)
    res = engine.generate([_req(i, "12+5=", temperature=2.0, max_new_tokens=1) for i in range(4000)])
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([TOK.encode("12+5=")])).logits[0, -1] / 2.0, -1)
    top = int(probs.argmax())
    freq = sum(r.output_ids[0] == top for r in res) / 4000
    sd = math.sqrt(probs[top].item() * (1 - probs[top].item()) / 4000)  # binomial standard error
    assert abs(freq - probs[top].item()) < 5 * sd
    lp = [r.behavior_logprobs[0] for r in res if r.output_ids[0] == top]
    assert abs(lp[0] - math.log(probs[top].item())) < 1e-5


def test_update_weights_mid_generation_switches_version_and_policy():
    old, new = _model(3), _model(4)
    engine = GenerationEngine(_model(3), TOK, max_batch_size=2)
    for i, p in enumerate(PROMPTS[:3]):  # third request waits for a free slot
        engine.submit(_req(i, p, temperature=0.0, max_new_tokens=10))
    for _ in range(4):
        assert engine.step() == []
    engine.update_weights(new.state_dict(), version=7)
    assert engine.version == 7
    results = {}
    while engine.has_work():
        results.update((r.request_id, r) for r in engine.step())
    for rid in ("r0", "r1"):  # in flight during the update: 4 old tokens, then 6 new ones
        r = results[rid]
        assert r.versions == [0] * 4 + [7] * 6
        assert r.output_ids[:4] == _full_recompute_greedy(old, r.prompt_ids, 4)
        assert r.output_ids[4:] == _full_recompute_greedy(new, r.prompt_ids + r.output_ids[:4], 6)
    assert results["r2"].versions == [7] * 10  # admitted after the update
    assert results["r2"].output_ids == _full_recompute_greedy(new, results["r2"].prompt_ids, 10)
    with pytest.raises(ValueError, match="older"):
        engine.update_weights(new.state_dict(), version=6)


def test_continuous_batching_finishes_every_request_once():
    model = _model(5)
    engine = GenerationEngine(model, TOK, max_batch_size=3)
    lengths = [1, 7, 3, 12, 2, 5, 9, 4, 6, 8]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(lengths))]
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.submit(_req(i, p, temperature=0.0, max_new_tokens=n))
    seen = []
    while engine.has_work():
        finished = engine.step()
        assert engine.num_active() <= 3
        seen += finished
    assert sorted(r.request_id for r in seen) == sorted(f"r{i}" for i in range(10))
    for r in seen:
        i = int(r.request_id[1:])
        # joining and leaving the batch mid-flight must not change a sequence's tokens
        assert r.output_ids == _full_recompute_greedy(model, r.prompt_ids, lengths[i])


class _EosAt:
    """Tokenizer stand-in whose EOS is a chosen id."""

    def __init__(self, eos: int):
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_stops_at_eos_and_keeps_it():
    model = _model(6)
    ids = TOK.encode("305-47=")
    full = _full_recompute_greedy(model, ids, 10)
    eos = full[3]
    cut = full.index(eos) + 1  # first occurrence of that token ends the response
    engine = GenerationEngine(model, _EosAt(eos), max_batch_size=2)
    r = engine.generate([GenerationRequest("a", ids, SamplingParams(temperature=0.0, max_new_tokens=10))])[0]
    assert r.finish_reason == "stop" and r.output_ids == full[:cut] and len(r.versions) == cut


def test_bad_requests_are_rejected():
    engine = GenerationEngine(_model(0), TOK, max_batch_size=2)
    with pytest.raises(ValueError, match="empty"):
        engine.submit(GenerationRequest("x", []))
    with pytest.raises(ValueError, match="top_p"):
        engine.submit(GenerationRequest("x", [1, 5], SamplingParams(top_p=0.0)))
    engine.submit(GenerationRequest("x", [1, 5]))
    with pytest.raises(ValueError, match="already in flight"):
        engine.submit(GenerationRequest("x", [1, 6]))
    with pytest.raises(RuntimeError, match="idle"):
        engine.generate([GenerationRequest("y", [1, 5])])
    with pytest.raises(ValueError, match="max_batch_size"):
        GenerationEngine(_model(0), TOK, max_batch_size=0)


def test_a_group_prefills_its_prompt_once_and_keeps_exact_logprobs_across_an_update():
    """GRPO groups: each distinct prompt is prefilled once and copied to its group's rows; after a
    weight update each row prefills only its own tokens after the shared prompt. Behavior log-probs
    still equal a full recomputation under the version that drew each token."""
    old, new = _model(5), _model(6)
    engine = GenerationEngine(_model(5), TOK, max_batch_size=8, seed=2)
    fed = _spy_prefill(engine)
    prompts = ["12+5=", "305-47="]
    plen = [len(TOK.encode(p)) for p in prompts]
    for i in range(8):
        engine.submit(_req(i, prompts[i % 2], temperature=1.0, max_new_tokens=8))
    for _ in range(3):
        assert engine.step() == []
    assert fed == [(2, sum(plen), None)]  # two prompts, not eight
    engine.update_weights(new.state_dict(), version=1)
    results = []
    while engine.has_work():
        results += engine.step()
    # after the update: the two prompts again, then each row's 3 tokens after its prompt
    assert fed[1] == (2, sum(plen), None)
    assert fed[2] == (8, 8 * 3, [plen[i % 2] for i in range(8)])
    assert len(fed) == 3 and len(results) == 8
    assert len({tuple(r.output_ids) for r in results}) > 2  # the group's samples differ
    for r in results:
        assert r.versions == [0] * 3 + [1] * 5
        ids = torch.tensor([r.prompt_ids + r.output_ids])
        with torch.no_grad():
            ref_old = token_logprobs(old, ids, torch.ones_like(ids), temperature=1.0)[0, -8:]
            ref_new = token_logprobs(new, ids, torch.ones_like(ids), temperature=1.0)[0, -8:]
        got = torch.tensor(r.behavior_logprobs)
        assert (got[:3] - ref_old[:3]).abs().max().item() < 1e-4
        assert (got[3:] - ref_new[3:]).abs().max().item() < 1e-4


def test_a_prompt_already_in_the_cache_is_copied_not_prefilled_again():
    """A group admitted over several steps (fewer slots than samples): a later sample copies its
    prompt from a cached row of the group and feeds only the prompt's last token again; its
    behavior log-probs still equal a full recomputation."""
    model = _model(7)
    engine = GenerationEngine(_model(7), TOK, max_batch_size=3, seed=4)
    fed = _spy_prefill(engine)
    prompt = TOK.encode("305-47=")
    reqs = [GenerationRequest(f"r{i}", prompt, SamplingParams(temperature=1.0, max_new_tokens=n, stop_at_eos=False))
            for i, n in enumerate((2, 6, 6, 5))]
    for r in reqs:
        engine.submit(r)
    results = []
    while engine.has_work():
        results += engine.step()
    # step 1: the prompt once for 3 rows; step 3 (r0 done after 2 tokens): r3 from a cached row, 1 token fed
    assert fed == [(1, len(prompt), None), (1, 1, [len(prompt) - 1])]
    assert sorted(len(r.output_ids) for r in results) == [2, 5, 6, 6]
    for r in results:
        ids = torch.tensor([r.prompt_ids + r.output_ids])
        with torch.no_grad():
            ref = token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)[0, -len(r.output_ids):]
        assert (torch.tensor(r.behavior_logprobs) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("kernels", ["auto", "off"])
def test_distinct_prompts_compute_their_common_prefix_once_with_exact_logprobs(kernels):
    """Prompts that begin with the same 41 tokens (a chat template's system turn), two samples
    each: the first prompt in token order is prefilled whole, the three others copy the 41 tokens
    and prefill only their own; after a weight update the same again, then each row its own
    tokens. Behavior log-probs equal a full recomputation under the version that drew each token."""
    old, new = _model(8), _model(9)
    engine = GenerationEngine(_model(8), TOK, max_batch_size=8, seed=1, cpu_kernels=kernels)
    fed = _spy_prefill(engine)
    system = "1234567890" * 4
    prompts = [system + tail for tail in ("12+5=", "3-1=", "305-47=", "9=")]
    plen = [len(TOK.encode(p)) for p in prompts]
    shared = len(TOK.encode(system))  # <bos> and the 40 characters
    for i in range(8):
        engine.submit(_req(i, prompts[i % 4], temperature=1.0, max_new_tokens=6))
    for _ in range(2):
        assert engine.step() == []
    # the root "12+5=" sorts first ("1" < "3" < "9"); each of the other three computes its tail only
    prompts_once = [(1, plen[0], None), (3, sum(plen[1:]) - 3 * shared, [shared] * 3)]
    assert fed == prompts_once
    engine.update_weights(new.state_dict(), version=1)
    results = []
    while engine.has_work():
        results += engine.step()
    assert fed[2:] == prompts_once + [(8, 8 * 2, [plen[i % 4] for i in range(8)])]
    assert len(results) == 8
    for r in results:
        ids = torch.tensor([r.prompt_ids + r.output_ids])
        with torch.no_grad():
            ref_old = token_logprobs(old, ids, torch.ones_like(ids), temperature=1.0)[0, -6:]
            ref_new = token_logprobs(new, ids, torch.ones_like(ids), temperature=1.0)[0, -6:]
        got = torch.tensor(r.behavior_logprobs)
        assert r.versions == [0] * 2 + [1] * 4
        assert (got[:2] - ref_old[:2]).abs().max().item() < 1e-4
        assert (got[2:] - ref_new[2:]).abs().max().item() < 1e-4


def test_a_prompt_admitted_later_copies_the_system_turn_from_a_row_still_decoding():
    """Two slots, three prompts beginning with the same 41 tokens: the first two are prefilled whole
    (two prompts' branches would skip fewer than MIN_SKIPPED tokens); when the first finishes, the
    third copies its 42-token beginning from the row still decoding and computes only its own. Behavior
    log-probs equal a full recomputation."""
    model = _model(10)
    engine = GenerationEngine(_model(10), TOK, max_batch_size=2, seed=3)
    fed = _spy_prefill(engine)
    system = "1234567890" * 4
    prompts = [system + tail for tail in ("12+5=", "3-1=", "305-47=")]
    plen = [len(TOK.encode(p)) for p in prompts]
    shared = len(TOK.encode(system + "3"))  # "305-47=" and "3-1=" (the row still decoding) share the "3" too
    reqs = [_req(i, p, temperature=1.0, max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts, (2, 6, 5)))]
    results = engine.generate(reqs)
    assert fed == [(2, plen[0] + plen[1], None), (1, plen[2] - shared, [shared])]
    for r in results:
        ids = torch.tensor([r.prompt_ids + r.output_ids])
        with torch.no_grad():
            ref = token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)[0, -len(r.output_ids):]
        assert (torch.tensor(r.behavior_logprobs) - ref).abs().max().item() < 1e-4
