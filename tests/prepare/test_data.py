from tunegrid.cell.data.batches import BatchStream, tokenize_examples
from tunegrid.prepare.data import generate_examples


def test_generation_is_deterministic():
    assert generate_examples(20, 3) == generate_examples(20, 3)
    assert generate_examples(20, 3) != generate_examples(20, 4)


def test_tokenized_prompt_is_masked_and_padding_ignored(checkpoints):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoints["gemma3-hot"])
    tensors = tokenize_examples(generate_examples(4, 0), tok, 48)
    labels, mask = tensors["labels"], tensors["attention_mask"]
    assert tensors["input_ids"].shape == (4, 48)
    assert (labels[mask == 0] == -100).all()
    assert (labels[:, 0] == -100).all()  # the prompt is not trained on
    assert ((labels != -100).sum(dim=1) > 0).all()  # every row has a response to learn


def test_batches_are_a_function_of_seed_and_step(checkpoints):
    import torch

    tensors = {"input_ids": torch.arange(10).unsqueeze(1)}
    a, b = BatchStream(tensors, 4, 0), BatchStream(tensors, 4, 0)
    assert torch.equal(a.batch(7)["input_ids"], b.batch(7)["input_ids"])
    assert a.batch(0)["input_ids"].shape[0] == 4
    assert BatchStream(tensors, 16, 0).batch(0)["input_ids"].shape[0] == 16
