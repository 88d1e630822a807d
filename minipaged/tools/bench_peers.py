"""Peers for ``bench --peer``: the same workload through another engine on the same machine.

- ``hf``: Hugging Face transformers ``generate`` (a padded batch, a contiguous cache, float32).
- ``llamacpp``: llama.cpp through ``llama-cpp-python``, reading the model's own GGUF file (for
  SmolLM2, its Q4_1 blocks: the bytes ``--quantization gguf`` computes on). Every prompt is a
  sequence of its own in one llama.cpp context: each prompt prefilled, then one batch a step
  holding every sequence's next token, greedy (argmax of its logits), EOS ignored, as our
  workloads are.

``run_peer`` starts the peer in its own process (``python -m minipaged.tools.bench_peers``),
so its thread pool and ours never share an address space; the child prints one JSON line.
Needs ``pip install -e ".[peers]"`` (torch, transformers, llama-cpp-python, which pip builds
from source: docs/weights.md); minipaged itself never imports them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from ..boot import THREAD_ENV

PEER_CWD = tempfile.gettempdir()   # where the peer's process starts (see run_peer)
PEER_MODULES = {"hf": ("torch", "transformers"), "llamacpp": ("llama_cpp",)}   # what each peer imports


def check_peer_installed(peer: str, modules: dict[str, tuple[str, ...]] = PEER_MODULES) -> None:
    """A ValueError naming the missing packages (``modules[peer]``, those the peer imports) and the
    extra that installs them, before any model loads."""
    import importlib.util  # noqa: PLC0415

    missing = [m for m in modules[peer] if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"--peer {peer} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                         "not installed: "
                         "pip install -e '.[peers]' (llama-cpp-python is built from source, which takes a "
                         "while: docs/weights.md, 'llama.cpp as a peer')")


def run_peer(peer: str, model_dir: str, prompts: list[list[int]], output_len: int,
             device: str = "cpu", dtype: str = "float32") -> dict:
    """Run a peer on the same prompts in a child process (its threads never meet ours)."""
    import numba  # noqa: PLC0415 (only to ask how many threads we run)

    if peer == "llamacpp":   # its GGUF file: found (or, for a registry model, fetched) here
        from ..model.weights import gguf_path_of  # noqa: PLC0415

        model_dir = str(gguf_path_of(model_dir, reader="the llamacpp peer runs llama.cpp on the model's GGUF file"))
    cmd = [sys.executable, "-m", "minipaged.tools.bench_peers", peer, "--model-dir", os.path.abspath(model_dir),
           "--output-len", str(output_len), "--threads", str(numba.get_num_threads()),
           "--device", device, "--dtype", dtype]
    # The peer gets the environment the user gave us, not our thread settings
    # (passive OpenMP waiting would slow torch's own pool down).
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    # It starts in the temporary directory: ``python -m`` puts its working directory first on
    # sys.path, and in a checkout that holds this repository's top-level ``kernels/`` and
    # ``model/``, which transformers 5.25 then imports in place of Hugging Face's ``kernels``
    # package ("cannot import name 'CUDAProperties' from 'kernels'").
    done = subprocess.run(cmd, input=json.dumps(prompts), capture_output=True, text=True, env=env,
                          cwd=PEER_CWD)
    if done.returncode != 0:   # its own last lines say why (a ValueError: one error line, no traceback of ours)
        raise ValueError(f"the {peer} peer failed in its own process; its last output:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def hf_generate(model_dir: str, prompts: list[list[int]], output_len: int, threads: int,
                device: str = "cpu", dtype: str = "float32") -> dict:
    """One padded batch of all prompts (left padding, contiguous cache), greedy, EOS ignored."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids=ids[:1, -8:], attention_mask=mask[:1, -8:], **{**kwargs, "max_new_tokens": 2,
                                                                                 "min_new_tokens": 2})
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - width) * len(prompts)
    return {"peer": "hf-transformers", "elapsed_s": elapsed, "generated_tokens": generated,
            "generation_tok_s": generated / elapsed,
            "total_tok_s": (sum(len(p) for p in prompts) + generated) / elapsed,
            "torch": torch.__version__, "transformers": transformers.__version__, "threads": threads,
            "torch_threads": torch.get_num_threads(), "device": device, "dtype": dtype}


def llamacpp_generate(gguf: str, prompts: list[list[int]], output_len: int, threads: int) -> dict:
    """Every prompt a sequence of one llama.cpp context (``llama-cpp-python``'s bindings of its C
    API, as llama.cpp's own ``batched`` example drives it): prefills, then one batch a step."""
    import llama_cpp as lc  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(gguf.encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    n_seq = len(prompts)
    params = lc.llama_context_default_params()
    params.n_ctx = sum(len(p) + output_len for p in prompts) + 16
    params.n_batch = params.n_ubatch = max(max(len(p) for p in prompts), n_seq)
    params.n_seq_max = n_seq
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(params.n_batch, 0, 1)

    def decode(entries):            # [(token, position, sequence, want logits)] -> their logits' argmax
        for i, (token, pos, seq, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, want
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax())
                for i, entry in enumerate(entries) if entry[3]]

    def run(prompts_, steps):
        nexts = [decode([(t, i, s, i == len(p) - 1) for i, t in enumerate(p)])[0] for s, p in enumerate(prompts_)]
        first = time.perf_counter()
        for step in range(steps - 1):
            nexts = decode([(nexts[s], len(p) + step, s, True) for s, p in enumerate(prompts_)])
        return first

    run([prompts[0][-8:]], 3)                                    # warm up: load and touch the weights
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
    start = time.perf_counter()
    first = run(prompts, output_len)
    elapsed = time.perf_counter() - start
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    generated = output_len * n_seq
    return {"peer": "llama.cpp", "elapsed_s": elapsed, "generated_tokens": generated,
            "generation_tok_s": generated / elapsed, "decode_tok_s": (generated - n_seq) / (elapsed - (first - start)),
            "total_tok_s": (sum(len(p) for p in prompts) + generated) / elapsed, "gguf": os.path.basename(gguf),
            "llama_cpp_python": lc.__version__, "threads": threads}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("peer", choices=["hf", "llamacpp"])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--output-len", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    prompts = json.loads(sys.stdin.read())
    if args.peer == "llamacpp":
        print(json.dumps(llamacpp_generate(args.model_dir, prompts, args.output_len, args.threads)))
    else:
        print(json.dumps(hf_generate(args.model_dir, prompts, args.output_len, args.threads, args.device, args.dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
