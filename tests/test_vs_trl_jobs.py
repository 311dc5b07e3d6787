"""bench/vs_trl_jobs.py: what bench/vs_trl.py gives TRL is what areal-flow uses, without TRL
installed: the prompt TRL tokenizes gives the generator's token ids, the reward is the run's
rule reward, the chat job's reward node and chat template are read from its compiled plan, and
the variants are the product of the options given."""

import pickle
import sys
from pathlib import Path

import pytest
from markers import needs_smollm2

# bench/ is scripts, not an installed package: put the repo root on the path as its scripts do
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vs_trl_jobs import JOBS, SharedReward, shared_settings, trl_prompt, variants  # noqa: E402

from areal_flow.models.tokenizer import build_char_tokenizer  # noqa: E402
from areal_flow.ops.generate import encode_prompt  # noqa: E402


def test_variants_are_the_product_with_labels():
    runs = variants(["1", "0h"], ["float32", "auto"], [0, 1], [False, True])
    assert [v.label for v in runs] == [
        "areal k=1 float32", "areal k=1 auto", "areal k=0h float32", "areal k=0h auto",
        "TRL fp32", "TRL bf16", "TRL t=1 fp32", "TRL t=1 bf16"]
    assert (runs[3].side, runs[3].k, runs[3].gen_dtype) == ("areal", "0h", "auto")
    assert (runs[7].side, runs[7].threads, runs[7].bf16) == ("trl", 1, True)
    assert [v.label for v in variants(["2"], [""], [0], [False])] == ["areal k=2", "TRL fp32"]  # the yaml's dtype
    with pytest.raises(ValueError, match="no variant"):
        variants([], [""], [], [False])


def test_plain_prompt_is_passed_as_is():
    tok = build_char_tokenizer()  # no chat template: TRL's tokenizer(text=...) adds <bos> as encode does
    text = trl_prompt(tok, "37+58=", None)
    assert text == "37+58="
    assert tok(text=text)["input_ids"] == encode_prompt(tok, "37+58=")


def test_shared_reward_is_the_rule_reward_and_pickles():
    reward = pickle.loads(pickle.dumps(SharedReward("math")))
    assert reward.__name__ == "math_reward"
    # the math rule scores the final number: "37 + 58 = 95" is right, "= 170" and "" are not
    assert reward(completions=["37 + 58 = 95", "37 + 58 = 170", ""], answer=["95", "95", "95"]) == [1.0, 0.0, 0.0]
    # the exact-integer rule (main job): only a bare integer counts
    assert SharedReward("arithmetic")(["95", "95 apples"], ["95", "95"]) == [1.0, 0.0]
    with pytest.raises(KeyError, match="not one of"):
        SharedReward("nope")


@needs_smollm2
def test_chat_job_prompts_and_reward_match_the_generator():
    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config
    from areal_flow.models.hf import resolve_folder
    from areal_flow.models.tokenizer import load_tokenizer
    from compiler.program import compile_program

    root = Path(__file__).resolve().parents[1]
    graph = JOBS["chat"].graph
    cfg = load_config(root / "graphs" / f"{graph}.yaml", [])
    shared = shared_settings(compile_program(load_flow(root / "graphs" / f"{graph}.py")(cfg), cfg))
    assert shared == {"reward": "math", "chat_template": None,  # the graph's ops.reward(fn="math"), template default
                      "mask_truncated": True}  # the yaml's train.loss.mask_truncated
    unmasked = load_config(root / "graphs" / f"{graph}.yaml", ["train.loss.mask_truncated=false"])
    plan = compile_program(load_flow(root / "graphs" / f"{graph}.py")(unmasked), unmasked)
    assert shared_settings(plan)["mask_truncated"] is False

    tok = load_tokenizer(resolve_folder("smollm2-135m"))
    question = "What is 37 + 58? Answer with just the number."
    text = trl_prompt(tok, question, shared["chat_template"])
    assert text.startswith("<|im_start|>system\n") and text.endswith(f"{question}<|im_end|>\n<|im_start|>assistant\n")
    assert tok(text=text)["input_ids"] == encode_prompt(tok, question)  # TRL's tokenization = the generator's ids


def test_trainer_dtypes_multiply_the_areal_variants_and_name_themselves():
    runs = variants(["1"], ["auto"], [0], [True], ("float32", "bfloat16"))
    assert [v.label for v in runs] == ["areal k=1 auto train=float32", "areal k=1 auto train=bfloat16", "TRL bf16"]
    assert [v.train_dtype for v in runs[:2]] == ["float32", "bfloat16"]


def test_core_lending_and_trls_malloc_multiply_their_sides_and_name_themselves():
    runs = variants(["1"], ["auto"], [0], [True], ("",), (True, False), (True, False))
    assert [v.label for v in runs] == ["areal k=1 auto lend=on", "areal k=1 auto lend=off", "TRL bf16",
                                       "TRL bf16 glibc-malloc"]
    assert [v.lend for v in runs[:2]] == [True, False] and [v.malloc for v in runs[2:]] == [True, False]
    assert variants(["1"], [""], [0], [True])[0].lend is None  # not set: the default, no override


def test_trls_sampling_offset_multiplies_its_variants_and_names_itself():
    runs = variants(["2"], [""], [0], [False], trl_rngs=(0, 1))
    assert [v.label for v in runs] == ["areal k=2", "TRL fp32", "TRL fp32 rng+1"]
    assert [v.rng for v in runs] == [0, 0, 1]
