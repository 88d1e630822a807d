"""PrefixCache: the page cache of the KV pool: full blocks found again by what they hold.

A full block is named by a chain hash: the hash of its parent block's name and
its own token ids, so equal names mean equal tokens *at equal positions* (the
same prefix all the way back). A new request looks its prompt up block by
block and reuses every block of its longest cached prefix, the way an OS maps
an already-loaded page of a shared library instead of reading the file again.

When the last holder frees a named block it is not wiped: it keeps its
contents and name and waits in an LRU queue, still counted as free. It is
evicted (its name forgotten) only when the allocator needs a block and no
plain free one is left, oldest first.
"""

from __future__ import annotations

from collections import OrderedDict


def chain_hash(parent: int | None, tokens: tuple[int, ...], salt: str | None = None) -> int:
    """Name of a full block: its parent's name and its token ids (Python's hash of ints is stable).

    A first block (no parent) of a salted request mixes the salt in, so its whole chain of
    names differs from every other salt's: requests share cached blocks only within a salt.
    """
    if parent is None and salt is not None:
        return hash(("salt", salt, tokens))
    return hash((parent, tokens))


def prompt_block_hashes(token_ids: list[int], block_size: int, num_blocks: int,
                        salt: str | None = None) -> list[int]:
    """Chain hashes of the first ``num_blocks`` full blocks of a token list (``salt``: the
    request's cache_salt, mixed into the first)."""
    hashes, parent = [], None
    for i in range(num_blocks):
        parent = chain_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), salt)
        hashes.append(parent)
    return hashes


class PrefixCache:
    def __init__(self) -> None:
        self.block_of: dict[int, int] = {}              # name -> block id
        self.name_of: dict[int, int] = {}               # block id -> name
        self.tokens_of: dict[int, tuple[int, ...]] = {}  # block id -> the tokens it holds (to verify hits)
        # Freed named blocks, least recently used first. An OrderedDict is a hash map
        # threaded on a doubly linked list: a hit removes a block from the middle in O(1).
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.queries = 0   # prompt tokens looked up
        self.hits = 0      # of those, tokens found in the cache

    def lookup(self, name: int, tokens: tuple[int, ...]) -> int | None:
        """The block holding exactly these tokens under this name, if any."""
        block = self.block_of.get(name)
        if block is not None and self.tokens_of[block] == tokens:
            return block
        return None

    def register(self, block: int, name: int, tokens: tuple[int, ...]) -> None:
        """A block just became full and computed: remember it (first holder of a name wins)."""
        if name in self.block_of or block in self.name_of:
            return
        self.block_of[name] = block
        self.name_of[block] = name
        self.tokens_of[block] = tokens

    def park(self, block: int) -> bool:
        """The last holder let go: keep a named block for later hits. False: not named."""
        if block not in self.name_of:
            return False
        self.evictable[block] = None
        return True

    def revive(self, block: int) -> None:
        """A hit on a parked block: it is in use again."""
        del self.evictable[block]

    def evict(self) -> int:
        """Take the least recently used parked block and forget its name."""
        block, _ = self.evictable.popitem(last=False)
        name = self.name_of.pop(block)
        del self.block_of[name]
        del self.tokens_of[block]
        return block

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
