"""Peers for ``bench --peer hf``: the same workload through Hugging Face transformers ``generate``.

``run_peer`` starts the peer in its own process (``python -m minipaged.tools.bench_peers``),
so torch's thread pool and ours never share an address space; the child prints one
JSON line. Needs ``pip install -e ".[peers]"`` (torch, transformers); minipaged itself
never imports them.
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


def run_peer(peer: str, model_dir: str, prompts: list[list[int]], output_len: int,
             device: str = "cpu", dtype: str = "float32") -> dict:
    """Run a peer on the same prompts in a child process (its threads never meet ours)."""
    import numba  # noqa: PLC0415 (only to ask how many threads we run)

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
    if done.returncode != 0:
        raise RuntimeError(f"the {peer} peer failed (is the 'peers' extra installed?):\n{done.stderr[-2000:]}")
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("peer", choices=["hf"])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--output-len", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    prompts = json.loads(sys.stdin.read())
    print(json.dumps(hf_generate(args.model_dir, prompts, args.output_len, args.threads, args.device, args.dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
