"""train/finish.heldout_prompts: the prompts of the end-of-run train/serve check."""

import datasets

from draftheads.data.stdlib import read_source, stdlib_files
from draftheads.train.finish import heldout_prompts
from tests.chat_tokenizers import plain_tokenizer


def test_prompts_are_the_real_tokens_of_heldout_rows():
    rows = {"input_ids": [[5, 6, 7, 8, 0, 0], [9, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6], [4, 4, 4, 4, 4, 4]],
            "attention_mask": [[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0], [1] * 6, [1] * 6]}
    ds = datasets.Dataset.from_dict(rows).with_format("torch")
    prompts, origin = heldout_prompts(ds, None, num_prompts=2, prompt_tokens=5)
    assert prompts == [[5, 6, 7, 8], [1, 2, 3, 4, 5]]  # padding dropped, rows of one token skipped
    assert origin == "2 held-out rows"


def test_without_heldout_rows_prompts_come_from_the_stdlib_eval_split():
    tokenizer = plain_tokenizer()
    empty = datasets.Dataset.from_dict({"input_ids": [], "attention_mask": []}).with_format("torch")
    prompts, origin = heldout_prompts(empty, tokenizer, num_prompts=3, prompt_tokens=16)
    assert len(prompts) == 3 and all(2 <= len(p) <= 16 for p in prompts) and "stdlib eval-split" in origin
    first = tokenizer(read_source(stdlib_files("eval")[0]), add_special_tokens=False)["input_ids"][:16]
    assert prompts[0] == first
