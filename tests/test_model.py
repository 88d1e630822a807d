"""The paged Llama forward against the dense reference, on tiny random models."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from minipaged.kernels.fast.ops import FastOps
from minipaged.kernels.layout import AttentionMetadata, kv_cache_shape
from minipaged.model.config import LlamaConfig
from minipaged.model.fetch import ModelFormatError
from minipaged.model import llama
from minipaged.model.llama import LlamaModel
from minipaged.model.reference import DenseReference
from minipaged.model.weights import load_checkpoint, read_safetensors


def load(model_dir):
    config = LlamaConfig.from_dir(model_dir)
    tensors = load_checkpoint(model_dir)
    return config, LlamaModel(config, tensors, FastOps()), DenseReference(config, tensors)


@pytest.mark.parametrize("mlp_chunk", [None, 7])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("which", ["tiny_model_dir", "untied_model_dir"])
def test_paged_forward_matches_dense_reference(request, monkeypatch, which, block_size, mlp_chunk):
    """Three sequences fed in random chunks (prefill, partial prefill, decode) through
    shuffled physical blocks; every logit row equals the dense model's, within 1e-4. With
    mlp_chunk, batches over 7 tokens run the MLP 7 tokens at a time (a long prefill's path,
    ``model/llama.py`` MLP_CHUNK_TOKENS), the last chunk partial."""
    if mlp_chunk is not None:
        monkeypatch.setattr(llama, "MLP_CHUNK_TOKENS", mlp_chunk)
    config, model, ref = load(request.getfixturevalue(which))
    rng = np.random.default_rng(block_size)
    seqs = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (37, 5, 20)]
    expected = [ref.logits(s) for s in seqs]                       # (len, vocab) each
    num_blocks = sum(-(-len(s) // block_size) for s in seqs) + 2
    kv = np.zeros(kv_cache_shape(config.num_hidden_layers, num_blocks, config.num_key_value_heads,
                                 block_size, config.head_dim), np.float32)
    free = list(rng.permutation(num_blocks))
    tables = [[] for _ in seqs]
    done = [0] * len(seqs)
    while any(d < len(s) for d, s in zip(done, seqs)):
        active = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
        for i in active:
            n = int(rng.integers(1, len(seqs[i]) - done[i] + 1))
            for pos in range(done[i], done[i] + n):
                if pos % block_size == 0:
                    tables[i].append(int(free.pop()))
                ids.append(seqs[i][pos])
                positions.append(pos)
                slots.append(tables[i][pos // block_size] * block_size + pos % block_size)
            q_lens.append(n)
            done[i] += n
            seq_lens.append(done[i])
        block_tables = np.full((len(active), max(len(tables[i]) for i in active)), -1, np.int32)
        for row, i in enumerate(active):
            block_tables[row, :len(tables[i])] = tables[i]
        meta = AttentionMetadata(np.array(slots, np.int64),
                                 np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                                 np.array(seq_lens, np.int32), block_tables, max(q_lens), max(seq_lens))
        logits = model.forward(np.array(ids), np.array(positions), kv, meta, np.arange(len(ids)))
        row = 0
        for i, n, end in zip(active, q_lens, seq_lens):
            np.testing.assert_allclose(logits[row:row + n], expected[i][end - n:end], atol=1e-4, rtol=1e-4)
            row += n


def test_bf16_checkpoints_are_widened(tmp_path):
    values = np.array([1.0, -2.5, 3.140625, 0.0], np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)       # exact: these fit in bfloat16
    path = tmp_path / "w.safetensors"
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bf16.tobytes())
    np.testing.assert_array_equal(read_safetensors(path)["w"], values)


def test_float32_weights_are_memory_mapped(tmp_path):
    save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(tmp_path / "m.safetensors"))
    a = read_safetensors(tmp_path / "m.safetensors")["a"]
    assert isinstance(a.base, np.memmap) or isinstance(a, np.memmap)
    np.testing.assert_array_equal(a, np.arange(6).reshape(2, 3))


def test_not_a_llama_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelFormatError, match="Llama"):
        LlamaConfig.from_dir(tmp_path)


def test_missing_tensor_is_named(tiny_model_dir):
    config = LlamaConfig.from_dir(tiny_model_dir)
    tensors = dict(load_checkpoint(tiny_model_dir))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelFormatError, match="model.layers.1.mlp.up_proj.weight"):
        LlamaModel(config, tensors, FastOps())
