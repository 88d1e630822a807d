"""Draw the figures of docs/ from real block-manager state: python docs/make_figures.py.

  docs/img/walkthrough.svg  two requests on a pool that has been in use (block size 4):
                            "Four score and seven years ago our" and "It was the best of times",
                            then one decode step each (the classic PagedAttention walk-through)
  docs/img/cow_fork.svg     two samples of one prompt share its blocks; the first divergent
                            write copies the shared, partly filled block (copy-on-write)
  docs/img/sliding_window.svg  blocks one sequence holds against its tokens, with a sliding
                            window of 32 (block size 4): released as they slide out, or kept
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


def blocks_held(window: int, prompt: int = 20, new_tokens: int = 160) -> list[tuple[int, int]]:
    """(tokens, blocks in use) after each decode of one sequence, as the engine's steps go: the
    slid-out blocks released first (``sliding_window`` = window; 0 keeps them), then a slot."""
    manager = BlockManager(num_blocks=64, block_size=4, watermark=0.0, sliding_window=window)
    seq = Sequence(0, list(range(prompt)))
    manager.allocate(SequenceGroup("0", [seq], SamplingParams()))
    seq.num_computed_tokens = seq.num_tokens
    held = []
    for token in range(new_tokens):
        manager.release_slid_out(seq)
        seq.output_token_ids.append(token)
        manager.append_slots(seq)
        seq.num_computed_tokens = seq.num_tokens
        manager.check_invariants([seq])
        held.append((seq.num_tokens, manager.num_used_blocks))
    return held


def sliding_window() -> str:
    """A line chart (SVG) of blocks_held with the window's release and without."""
    curves = {"released as they slide out (window 32)": (blocks_held(32), "#1f77b4"),
              "kept (full attention, or no release)": (blocks_held(0), "#d62728")}
    width, height, left, bottom = 640, 300, 50, 40
    top_tokens = max(t for held, _ in curves.values() for t, _ in held)
    top_blocks = max(b for held, _ in curves.values() for _, b in held)
    x = lambda t: left + (width - left - 20) * t / top_tokens                  # noqa: E731
    y = lambda b: height - bottom - (height - bottom - 30) * b / top_blocks   # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="12">', '<rect width="100%" height="100%" fill="#fff"/>',
           f'<text x="{left}" y="18" font-weight="bold">KV blocks one sequence holds (block size 4, 20-token prompt)</text>',
           f'<line x1="{left}" y1="{y(0)}" x2="{width - 20}" y2="{y(0)}" stroke="#333"/>',
           f'<line x1="{left}" y1="{y(0)}" x2="{left}" y2="30" stroke="#333"/>',
           f'<text x="{width // 2}" y="{height - 8}" text-anchor="middle">tokens in the sequence</text>']
    for t in range(0, top_tokens + 1, 40):
        out.append(f'<text x="{x(t):.1f}" y="{y(0) + 16}" text-anchor="middle">{t}</text>')
    for b in range(0, top_blocks + 1, 10):
        out.append(f'<text x="{left - 6}" y="{y(b) + 4:.1f}" text-anchor="end">{b}</text>')
    for i, (label, (held, color)) in enumerate(curves.items()):
        points = " ".join(f"{x(t):.1f},{y(b):.1f}" for t, b in held)
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{left + 12}" y="{44 + 16 * i}" fill="{color}">{label}: at most '
                   f'{max(b for _, b in held)} blocks</text>')
    print("sliding window:", {label: max(b for _, b in held) for label, (held, _) in curves.items()})
    return "\n".join(out + ["</svg>"]) + "\n"


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    (OUT / "walkthrough.svg").write_text(walkthrough())
    (OUT / "cow_fork.svg").write_text(cow_fork())
    (OUT / "sliding_window.svg").write_text(sliding_window())
