"""Verifier.load_head: what training on cached features holds of the verifier (embedding, lm_head, final norm),
read by name from the safetensors files, equal to the whole model's tensors, with the same fingerprint."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftheads.models.verifier import Verifier, VerifierError
from tests.utils import save_tiny_verifier


def held(verifier) -> dict[str, torch.Tensor]:
    """Every parameter and buffer not on the meta device, by name (a tied tensor under each of its names)."""
    named = [*verifier.model.named_parameters(remove_duplicate=False), *verifier.model.named_buffers()]
    return {name: t for name, t in named if t.device.type != "meta"}


@pytest.mark.parametrize("family, tied", [("llama", False), ("qwen2", True)])
def test_head_holds_embedding_lm_head_and_norm_only(tmp_path, family, tied):
    folder = save_tiny_verifier(tmp_path / "v", family, tie_word_embeddings=tied)
    whole = Verifier.from_pretrained(folder, dtype="bfloat16")
    head = Verifier.load_head(folder, dtype="bfloat16", device="cpu")
    assert head.head_only and not whole.head_only
    names = set(held(head))
    assert names == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    assert not any(".layers." in n for n, p in head.model.named_parameters() if p.device.type != "meta")
    for name, tensor in held(head).items():
        assert tensor.dtype == torch.bfloat16 and not tensor.requires_grad
        assert torch.equal(tensor, whole.model.get_parameter(name)), name
    assert (head.lm_head.weight is head.embed_tokens.weight) == tied
    H, V = head.hidden_size, head.vocab_size
    assert head.held_bytes() == 2 * (V * H * (1 if tied else 2) + H)
    assert head.held_bytes() < whole.held_bytes() / 3
    assert head.describe() == whole.describe()  # name, fingerprint and shapes: what runs and exports record
    assert (head.device, head.dtype, head.num_layers, head.default_eagle3_layers()) == (
        whole.device, whole.dtype, whole.num_layers, whole.default_eagle3_layers())


def test_head_refuses_what_runs_the_layers(llama_dir):
    head = Verifier.load_head(llama_dir, dtype="float32")
    ids = torch.zeros(1, 3, dtype=torch.long)
    for call in (lambda: head.features(ids), lambda: head(ids), head.check_head, head.check_document_mask):
        with pytest.raises(VerifierError, match="loaded head-only .* needs its layers: load it with "
                                                "Verifier.from_pretrained"):
            call()


def test_head_with_layers_reads_them_too(llama_dir):
    whole = Verifier.from_pretrained(llama_dir, dtype="float32")
    head = Verifier.load_head(llama_dir, dtype="float32", layers=[2])
    assert {n for n in held(head) if ".layers." in n} == {f"model.layers.2.{n}" for n, _ in
                                                          whole.layers[2].named_parameters()}
    for name, p in head.layers[2].named_parameters():
        assert torch.equal(p, whole.layers[2].get_parameter(name))
    with pytest.raises(VerifierError, match=r"layers=\[9\]: \[9\] out of range"):
        Verifier.load_head(llama_dir, layers=[9])


def test_head_reads_a_sharded_checkpoint(tmp_path, llama_dir):
    """Tensors spread over several files (an index json beside them, as hub checkpoints are) are found by name."""
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text((llama_dir / "config.json").read_text())
    tensors = load_file(llama_dir / "model.safetensors")
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if "lm_head" not in k},
              "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if "lm_head" in k}}
    for name, part in shards.items():
        save_file(part, folder / name, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}))
    head = Verifier.load_head(folder, dtype="float32")
    assert torch.equal(head.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(head.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    assert head.fingerprint == Verifier.from_pretrained(folder, dtype="float32").fingerprint


def test_head_names_a_missing_tensor(tmp_path, llama_dir):
    folder = tmp_path / "v"
    folder.mkdir()
    (folder / "config.json").write_text((llama_dir / "config.json").read_text())
    tensors = load_file(llama_dir / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, folder / "model.safetensors")
    with pytest.raises(VerifierError, match=r"no tensor 'lm_head.weight' in its safetensors files"):
        Verifier.load_head(folder)


@pytest.mark.parametrize("family, tied", [("llama", False), ("qwen2", True)])
def test_keep_head_rows_frees_the_other_rows_unless_tied(tmp_path, family, tied):
    """An EAGLE-3 run on a cache that stored the argmax keeps only its draft vocabulary's rows of lm_head."""
    folder = save_tiny_verifier(tmp_path / "v", family, tie_word_embeddings=tied)
    head = Verifier.load_head(folder, dtype="float32", device="cpu")
    whole = head.lm_head.weight.detach().clone()
    H, V = head.hidden_size, head.vocab_size
    ids = torch.tensor([7, 3, V - 1, 40])
    rows = head.keep_head_rows(ids)
    assert head.holds_whole_head == tied and torch.equal(head.lm_head_rows(ids), whole[ids])
    if tied:  # a tied head is the embedding: nothing to free, and no copy of the rows kept beside it
        assert rows is None and head.held_bytes() == 4 * (V * H + H)
        return
    assert torch.equal(rows, whole[ids])
    assert head.lm_head.weight.device.type == "meta"
    assert head.held_bytes() == 4 * (V * H + len(ids) * H + H)  # embedding, the 4 rows, norm
    assert torch.equal(head.lm_head_rows(torch.tensor([40, 7])), whole[[40, 7]])  # a subset, in any order
    with pytest.raises(VerifierError, match=r"holds 4 rows of its lm_head .*token ids \[5\] were freed"):
        head.lm_head_rows(torch.tensor([7, 5]))


def test_head_argmax_is_the_argmax_of_the_logits_in_any_chunking(llama_dir):
    head = Verifier.load_head(llama_dir, dtype="float32", device="cpu")
    final = torch.randn(3, 5, head.hidden_size)
    want = head.lm_head(final).max(-1).indices
    for chunk_bytes in (1, 7 * head.vocab_size * 4, 1 << 28):  # one position, 7 (a ragged tail), all at once
        got = head.head_argmax(final, chunk_bytes=chunk_bytes)
        assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    # a head with a bias (a remote-code family): its argmax counts the bias, and no row is freed
    head.lm_head.bias = torch.nn.Parameter(torch.zeros(head.vocab_size).index_fill_(0, torch.tensor([5]), 1e4),
                                           requires_grad=False)
    assert (head.head_argmax(final) == 5).all()
    assert head.keep_head_rows(torch.tensor([5, 6])) is None and head.holds_whole_head


@pytest.mark.parametrize("family, tied", [("llama", False), ("qwen2", True)])
def test_embedding_held_apart_from_the_head(tmp_path, family, tied):
    """`embedding_device`: the table is read there and the rest onto `device` (here the meta device stands for a
    GPU); a tied table is the head's, so it stays with the head."""
    folder = save_tiny_verifier(tmp_path / "v", family, tie_word_embeddings=tied)
    whole = Verifier.from_pretrained(folder, dtype="float32")
    head = Verifier.load_head(folder, dtype="float32", device="meta", embedding_device="cpu")
    assert head.embedding_held_apart == (not tied) and head.device.type == "meta"
    assert head.lm_head.weight.device.type == head.norm.weight.device.type == "meta"
    if tied:
        assert head.embed_tokens.weight.device.type == "meta" and head.held_bytes() == 0
        return
    assert torch.equal(head.embed_tokens.weight, whole.embed_tokens.weight)
    assert head.held_bytes() == 4 * head.vocab_size * head.hidden_size  # the table alone is in host memory
    same = Verifier.load_head(folder, dtype="float32", device="cpu", embedding_device="cpu")
    assert not same.embedding_held_apart and same.device.type == "cpu"


def test_embedding_rows_come_back_where_the_ids_are():
    from draftheads.models.placed import embedding_rows

    table, ids = torch.randn(10, 4), torch.tensor([[3, 0, 9]])
    assert torch.equal(embedding_rows(table, ids), table[ids])  # across devices: the CUDA test below


@pytest.mark.cuda
def test_embedding_in_host_memory_beside_a_gpu_head_cuda(tmp_path):
    """On a GPU an offline run keeps the verifier's table in host memory: a drafter's embedded tokens arrive on the
    GPU, equal to the rows of the table."""
    from draftheads.models.eagle.config import EagleConfig
    from draftheads.models.eagle.drafter import build_drafter

    folder = save_tiny_verifier(tmp_path / "v", "llama")
    head = Verifier.load_head(folder, dtype="float32", device="cuda", embedding_device="cpu")
    assert head.embedding_held_apart and head.device.type == "cuda" and head.embed_tokens.weight.device.type == "cpu"
    drafter = build_drafter(head, EagleConfig(version=3))
    ids = torch.tensor([[1, 5, 7]], device="cuda")
    got = drafter.embed(ids)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), head.embed_tokens.weight[ids.cpu()])
