"""Draw the figures of docs/ from real block-manager state: python docs/make_figures.py.

  docs/img/walkthrough.svg  two requests on a pool that has been in use (block size 4):
                            "Four score and seven years ago our" and "It was the best of times",
                            then one decode step each (the classic PagedAttention walk-through)
  docs/img/cow_fork.svg     two samples of one prompt share its blocks; the first divergent
                            write copies the shared, partly filled block (copy-on-write)
"""

from pathlib import Path

from minipaged.memory.block_manager import BlockManager
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup
from minipaged.tools.viz import render_svg, render_text, snapshot

OUT = Path(__file__).parent / "img"
WORDS: list[str] = []


def ids(text: str) -> list[int]:
    """Words as token ids (a toy vocabulary, so every slot shows a readable word)."""
    out = []
    for word in text.split():
        if word not in WORDS:
            WORDS.append(word)
        out.append(WORDS.index(word))
    return out


def request(manager: BlockManager, seq_id: int, text: str) -> Sequence:
    seq = Sequence(seq_id, ids(text))
    manager.allocate(SequenceGroup(str(seq_id), [seq], SamplingParams()))
    seq.num_computed_tokens = seq.num_tokens
    return seq


def decode(manager: BlockManager, seq: Sequence, word: str) -> list:
    seq.output_token_ids.append(ids(word)[0])
    copies = manager.append_slots(seq)
    seq.num_computed_tokens = seq.num_tokens
    return copies


def walkthrough() -> str:
    manager = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    # a pool that has served requests before: its free blocks are no longer in order
    held = [manager.allocator.allocate() for _ in range(8)]
    for block in (7, 1, 3, 6, 0, 4, 2, 5):
        manager.allocator.free(held[block])
    a = request(manager, 0, "Four score and seven years ago our")
    b = request(manager, 1, "It was the best of times")
    decode(manager, a, "fathers")
    decode(manager, b, "it")
    view = snapshot(manager, {"A": a, "B": b}, lambda t: WORDS[t])
    print(render_text(view))
    return render_svg(view, "Two requests, block size 4: logical blocks map to scattered physical blocks")


def cow_fork() -> str:
    manager = BlockManager(num_blocks=6, block_size=4, watermark=0.0)
    parent = Sequence(10, ids("The cat sat on the mat"))
    child = Sequence(11, list(parent.prompt_token_ids))
    manager.allocate(SequenceGroup("s", [parent, child], SamplingParams(n=2)))
    parent.num_computed_tokens = child.num_computed_tokens = parent.num_tokens
    copies = decode(manager, parent, "and") + decode(manager, child, "while")
    view = snapshot(manager, {"sample 0": parent, "sample 1": child}, lambda t: WORDS[t])
    print(render_text(view), "\ncopy-on-write copies:", copies)
    return render_svg(view, "Two samples of one prompt: the full block stays shared, the partial one was copied")


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    (OUT / "walkthrough.svg").write_text(walkthrough())
    (OUT / "cow_fork.svg").write_text(cow_fork())
