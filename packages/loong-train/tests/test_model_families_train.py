"""Three RL steps through Ray for a tiny checkpoint of each family ``transformers`` builds: the
fast path (Qwen2, Llama, Mistral) and the generic path (GPT-2, Phi). The engine generates with
it, the trainer trains it, and the final checkpoint loads back into ``transformers`` as the same
class. (Qwen3, the tiny recipes' own family, runs in every other end-to-end test.)"""

import json

import pytest
import transformers
from train_testkit import tiny_hf_checkpoint

from loong_train.config import load_recipe
from loong_train.controller import run
from loong_train.models.tokenizer import load_tokenizer
from loong_train.tiny.tokenizer import build_tokenizer

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral", "gpt2", "phi"])
def test_a_transformers_checkpoint_trains_through_the_torch_backend_and_the_embedded_engine(tmp_path, family):
    ckpt = tmp_path / family
    build_tokenizer(ckpt)
    tokenizer = load_tokenizer(ckpt)
    reference = tiny_hf_checkpoint(
        ckpt, family, std=0.02, vocab_size=len(tokenizer), eos=tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    sets = [f"model.path={ckpt}", "train.steps=3", "train.batch_groups=2", "rollout.group_size=2",
            "rollout.max_new_tokens=12", "rollout.max_model_tokens=24", "eval.every=3", "eval.num_tasks=4"]  # fmt: skip
    out = run(load_recipe("tiny-calc-agent", sets), tmp_path / "run", tmp_path / "cache")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["mismatch_kl"] < 1e-9
    final = transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "final")
    assert type(final) is type(reference)
    assert final.state_dict().keys() == reference.state_dict().keys()
