"""Pictures of the KV cache drawn from real engine state: the physical pool and the page tables.

``snapshot`` reads a block manager (and the sequences it serves) into a plain view;
``render_text`` prints it for a terminal (``generate --show-blocks``, ``chat
--show-blocks``), ``render_svg`` draws it for the docs: logical blocks of each
sequence on the left, the physical pool on the right, a line from every logical
block to the frame that holds it, shared frames marked, free ones grey.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

from ..memory.block_table import SLID_OUT

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ab"]


@dataclass
class BlockView:
    block_id: int
    owners: list[str]                  # names of the sequences whose tables hold it
    slots: list[str | None]            # text of each slot's token, None if empty
    state: str                         # "used", "reserved" (held for a request, not yet mapped: the
                                       # contiguous baseline), "free" or "cached" (free, contents kept)


@dataclass
class TableView:
    name: str
    entries: list[tuple[int, int, int]]   # (logical block, physical block, filled slots)
    slots: list[list[str | None]] = field(default_factory=list)  # per logical block, its tokens' text


@dataclass
class PoolView:
    block_size: int
    blocks: list[BlockView]
    tables: list[TableView]


def snapshot(block_manager, sequences: dict[str, object], token_text=str) -> PoolView:
    """Read the pool and the named sequences' tables; a slot shows the text of the token
    whose K/V it holds (tokens computed so far), empty slots show as empty."""
    size = block_manager.block_size
    owners: dict[int, list[str]] = {}
    contents: dict[int, list[str | None]] = {}
    tables = []
    for name, seq in sequences.items():
        table = block_manager.tables.get(seq.seq_id)
        if table is None or not table.resident:
            continue
        tokens = seq.token_ids
        view = TableView(name, [])
        for i, block in enumerate(table.block_ids):
            if block == SLID_OUT:        # the window slid past it: the entry maps no frame
                view.entries.append((i, block, 0))
                view.slots.append([None] * size)
                continue
            filled = min(max(seq.num_computed_tokens - i * size, 0), size)
            text = [token_text(tokens[i * size + j]) if j < filled else None for j in range(size)]
            view.entries.append((i, block, filled))
            view.slots.append(text)
            owners.setdefault(block, []).append(name)
            old = contents.get(block, [None] * size)
            contents[block] = [a if a is not None else b for a, b in zip(text, old)]
        tables.append(view)
    reserved_for = {}   # block -> name: held for a sequence's future tokens (contiguous baseline)
    for name, seq in sequences.items():
        if seq.seq_id in block_manager.tables:
            for block in block_manager.reserved_blocks(seq):
                reserved_for[block] = name
    cache = getattr(block_manager, "cache", None)
    blocks = []
    for block in range(block_manager.num_blocks):
        if block in owners:
            blocks.append(BlockView(block, owners[block], contents[block], "used"))
        elif block in reserved_for:
            blocks.append(BlockView(block, [reserved_for[block]], [None] * size, "reserved"))
        elif cache is not None and block in cache.evictable:
            blocks.append(BlockView(block, [], [token_text(t) for t in cache.tokens_of[block]], "cached"))
        elif block_manager.allocator.ref_counts[block] > 0:     # held but not by a named table
            blocks.append(BlockView(block, ["?"], [None] * size, "used"))
        else:
            blocks.append(BlockView(block, [], [None] * size, "free"))
    return PoolView(size, blocks, tables)


def engine_snapshot(engine) -> PoolView:
    """The pool of a running LLMEngine; sequences named by request id (and sample index)."""
    named = {}
    for group in engine.scheduler.running:
        for i, seq in enumerate(group.unfinished_seqs()):
            named[group.request_id if len(group.seqs) == 1 else f"{group.request_id}.{i}"] = seq
    tokenizer = engine.tokenizer
    return snapshot(engine.block_manager, named, lambda t: tokenizer.decode([t]))


def _cell(text: str | None, width: int) -> str:
    if text is None:
        return "·".center(width)
    text = text.replace("\n", "⏎").replace(" ", "␣") if text.strip() != text or "\n" in text else text
    return text[:width].ljust(width)


def render_text(view: PoolView, max_blocks: int = 64, cell: int = 6) -> str:
    """Page tables first, then the physical pool (only the first ``max_blocks`` frames)."""
    lines = [f"page tables (logical block -> physical block, slots filled of {view.block_size}):"]
    for table in view.tables:
        parts = [f"{logical}->{physical}({filled})" if physical != SLID_OUT else f"{logical}->-"
                 for logical, physical, filled in table.entries]
        lines.append(f"  {table.name:>8}: " + " ".join(parts))
    used = sum(b.state == "used" for b in view.blocks)
    reserved = sum(b.state == "reserved" for b in view.blocks)
    cached = sum(b.state == "cached" for b in view.blocks)
    lines.append(f"physical pool: {used} used, " + (f"{reserved} reserved, " if reserved else "")
                 + f"{cached} cached, {len(view.blocks) - used - reserved - cached} free of "
                 f"{len(view.blocks)} blocks")
    for block in view.blocks[:max_blocks]:
        if block.state == "free":
            continue
        who = ",".join(block.owners) if block.owners else "cache"
        if block.state == "reserved":
            who = f"reserved for {who}"
        shared = " shared" if len(block.owners) > 1 else ""
        slots = "|".join(_cell(t, cell) for t in block.slots)
        lines.append(f"  [{block.block_id:>3}] {slots}  <- {who}{shared}")
    hidden = sum(b.state != "free" for b in view.blocks[max_blocks:])
    if hidden:
        lines.append(f"  ... {hidden} more non-free blocks")
    return "\n".join(lines)


def render_svg(view: PoolView, title: str = "", max_blocks: int = 32) -> str:
    """Logical blocks of each sequence (left), the physical pool (right), a line per mapping."""
    size, slot_w, row_h, gap = view.block_size, 58, 26, 14
    block_w = size * slot_w
    left_x, right_x = 110, 110 + block_w + 170
    colors = {t.name: PALETTE[i % len(PALETTE)] for i, t in enumerate(view.tables)}
    pool = view.blocks[:max_blocks]
    left_rows = sum(len(t.entries) for t in view.tables) + len(view.tables)
    height = 60 + max(left_rows, len(pool)) * (row_h + 4) + gap
    width = right_x + block_w + 150
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="12">',
           f'<text x="10" y="20" font-size="15" font-weight="bold">{escape(title)}</text>',
           f'<text x="{left_x}" y="44" font-weight="bold">logical blocks (page tables)</text>',
           f'<text x="{right_x}" y="44" font-weight="bold">physical KV blocks</text>']
    pool_y = {b.block_id: 56 + i * (row_h + 4) for i, b in enumerate(pool)}

    def block_row(x, y, slots, fill, label):
        out.append(f'<text x="{x - 8}" y="{y + 17}" text-anchor="end">{escape(label)}</text>')
        for j, text in enumerate(slots):
            out.append(f'<rect x="{x + j * slot_w}" y="{y}" width="{slot_w}" height="{row_h}" '
                       f'fill="{fill if text is not None else "#fff"}" fill-opacity="0.35" stroke="#555"/>')
            if text is not None:
                out.append(f'<text x="{x + j * slot_w + 4}" y="{y + 17}">{escape(text.strip()[:7])}</text>')

    y = 56
    for table in view.tables:
        out.append(f'<text x="10" y="{y + 17}" fill="{colors[table.name]}" font-weight="bold">'
                   f'{escape(table.name)}</text>')
        for (logical, physical, _), slots in zip(table.entries, table.slots):
            block_row(left_x, y, slots, colors[table.name], f"{logical}")
            if physical in pool_y:
                out.append(f'<line x1="{left_x + block_w}" y1="{y + row_h / 2}" x2="{right_x}" '
                           f'y2="{pool_y[physical] + row_h / 2}" stroke="{colors[table.name]}" stroke-width="1.5"/>')
            y += row_h + 4
        y += row_h + 4
    for block in pool:
        fill = colors.get(block.owners[0], "#999") if block.owners else ("#bbb" if block.state == "cached" else "#fff")
        if block.state == "reserved":
            fill = "#eee"
        block_row(right_x, pool_y[block.block_id], block.slots, fill, f"{block.block_id}")
        note = ("shared x%d" % len(block.owners)) if len(block.owners) > 1 else (
            "cached, free" if block.state == "cached" else ("free" if block.state == "free" else (
                f"reserved for {block.owners[0]}" if block.state == "reserved" else "")))
        if note:
            out.append(f'<text x="{right_x + block_w + 8}" y="{pool_y[block.block_id] + 17}" '
                       f'fill="#555">{note}</text>')
    out.append("</svg>")
    return "\n".join(out)


def kv_map(engine) -> dict:
    """The whole KV cache as plain data (``GET /kv``): every block of the device pool and of
    the CPU swap pool, and every sequence's page table, from the engine's real state.

    A device block is "used" (some table maps it), "reserved" (held ahead for a request:
    the contiguous baseline), "cached" (free, its contents kept by the prefix cache) or
    "free"; a CPU block is "swapped" (holding a preempted request's K/V) or "free". ``fill``
    is the number of slots written, ``requests`` the requests whose tables map the block.
    Read it between two steps (the server does it on the engine's thread).
    """
    bm = engine.block_manager
    names: dict[int, str] = {}          # seq_id -> "request" or "request.sample"
    seqs = {}                           # seq_id -> Sequence
    for queue in (engine.scheduler.running, engine.scheduler.swapped, engine.scheduler.waiting):
        for group in queue:
            for i, seq in enumerate(group.seqs):
                names[seq.seq_id] = group.request_id if len(group.seqs) == 1 else f"{group.request_id}.{i}"
                seqs[seq.seq_id] = seq
    size = bm.block_size
    device = [{"id": b, "state": "free", "ref_count": int(bm.allocator.ref_counts[b]), "fill": 0, "requests": []}
              for b in range(bm.num_blocks)]
    cpu = [{"id": b, "state": "free", "ref_count": int(bm.cpu_allocator.ref_counts[b]), "fill": 0, "requests": []}
           for b in range(bm.cpu_allocator.num_blocks)]
    tables = []
    for seq_id, table in bm.tables.items():
        on_cpu = not table.resident           # wholly or partly paged out
        name = names.get(seq_id, f"seq {seq_id}")
        for block, fill, present in zip(table.block_ids, table.fills, table.present):
            if block == SLID_OUT:            # slid out of the window: no frame
                continue
            entry = (device if present else cpu)[block]
            entry["state"] = "used" if present else "swapped"
            entry["fill"] = max(entry["fill"], fill)
            request = name.split(".")[0]
            if request not in entry["requests"]:
                entry["requests"].append(request)
        tables.append({"sequence": name, "request": name.split(".")[0], "on_cpu": on_cpu,
                       "blocks": list(table.block_ids), "fills": list(table.fills),
                       "present": list(table.present)})
    cache = getattr(bm, "cache", None)
    for entry in device:
        if entry["state"] != "free":
            continue
        if cache is not None and entry["id"] in cache.evictable:
            entry["state"], entry["fill"] = "cached", size
        elif entry["ref_count"] > 0:
            entry["state"] = "reserved"
    for seq_id, seq in seqs.items():               # the contiguous baseline's reserved runs
        if seq_id in bm.tables and bm.tables[seq_id].resident:
            for block in bm.reserved_blocks(seq):
                device[block]["state"] = "reserved"
                device[block]["requests"] = [names[seq_id].split(".")[0]]
    counts = {state: sum(1 for e in device if e["state"] == state) for state in ("used", "cached", "reserved", "free")}
    return {"block_size": size, "num_blocks": bm.num_blocks, "num_cpu_blocks": bm.cpu_allocator.num_blocks,
            "counts": counts, "cpu_swapped": sum(1 for e in cpu if e["state"] == "swapped"),
            "device": device, "cpu": cpu, "tables": tables}

