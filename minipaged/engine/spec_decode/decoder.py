"""Speculative decoding: guess several tokens, let the model check them all in one pass.

The OS idea is speculative execution with rollback, in the memory manager's terms: before a
step, each decoding sequence may take a few draft tokens (``propose``); the scheduler maps
slots for them as it maps any slot (``append_slots`` with a lookahead, trimmed first when
blocks or the token budget run short); the model computes the newest token and every draft
in one pass of the flattened batch, mixed with the sequences that do not speculate; then
``verify`` keeps the drafts the model agrees with (engine/rejection_sampler.py) and the
engine rolls the page table back past the rejected ones (``BlockManager.rollback``): their
slots are unmapped, and a block that held only rejected positions is free again at once.
Prefix-cache names never cover a draft: a block is named only once its tokens are computed
and accepted.

Draft length. With ``adaptive`` (the default) each sequence keeps a running acceptance rate
a, the share of its drafted tokens that stood (the past weighted by ``DECAY`` at each of its
verifications; it starts at 0.5). If each draft stands with probability a, k drafts yield E(k) = (1 - a^(k+1)) / (1 - a)
tokens a step. A step's cost grows with its query rows: on a CPU the weights are read once
whatever the rows, and each row adds arithmetic, so a batch of B decodes costs about
``STEP_FIXED_ROWS + B`` rows' worth, and k more rows for one sequence cost c = B /
(STEP_FIXED_ROWS + B) of its share. The sequence takes the k in 0 .. num_speculative_tokens
that maximises E(k) / (1 + c k): none when a <= c, more as a grows. With k = 0 the n-gram
guess is still made (it is free) and checked against the token the model then produces, so
the rate recovers when the text starts repeating again. A draft model's guess is not free:
a sequence at k = 0 drafts one token every ``PROBE_EVERY`` steps instead, to keep measuring.

With a draft model (engine/draft_model.py) ``propose`` only fixes each sequence's draft
length; the scheduler maps the slots, then the draft model fills the drafts in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...config import SpeculativeConfig
from ...sequence import Sequence, SequenceGroup
from .ngram_proposer import propose_ngram
from .rejection_sampler import Verdict, verify_coupled, verify_greedy, verify_sampled
from ..sampler import SampleRequest, SampleResult, shaped_probs, to_host

# A decode step's fixed cost (reading every weight once), in query rows of arithmetic: on the
# 2-core CPU of docs/benchmarks.md, a step of 1 row took ~20 ms and each further row ~1.3 ms.
STEP_FIXED_ROWS = 16
DECAY = 0.8           # weight of the past in a sequence's acceptance rate, per step
PRIOR = (1.0, 2.0)    # (accepted, tried): a new sequence's rate starts at 0.5
PROBE_EVERY = 8       # a draft model at k = 0 still drafts one token this often (steps)
DRAFT_PLACEHOLDER = -1   # a draft model's token before it is drafted (after the schedule)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step yields with k drafts that each stand with probability ``rate``."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


def best_draft_length(rate: float, k_max: int, row_cost: float) -> int:
    """The k in 0 .. k_max maximising expected tokens per unit of step cost, 1 + row_cost * k
    (the smallest such k on a tie, so no speculation when it cannot win)."""
    best, best_value = 0, 1.0
    for k in range(1, k_max + 1):
        value = expected_tokens(rate, k) / (1.0 + row_cost * k)
        if value > best_value + 1e-12:
            best, best_value = k, value
    return best


@dataclass
class Acceptance:
    """One sequence's running record: drafted tokens that stood, of those tried (decayed)."""

    accepted: float = PRIOR[0]
    tried: float = PRIOR[1]
    shadow: tuple[int, int] | None = None   # (output length when guessed, guessed token), k = 0
    idle_steps: int = 0                     # steps since it last drafted (draft model, k = 0)

    @property
    def rate(self) -> float:
        return self.accepted / self.tried

    def update(self, accepted: int, tried: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + tried


@dataclass
class SpecDecodeStats:
    draft_tokens: int = 0        # drafts the model verified
    accepted_tokens: int = 0     # drafts that stood (the model agreed with them)
    verify_steps: int = 0        # (sequence, step) pairs that verified at least one draft
    emitted_tokens: int = 0      # tokens those steps put in the output (accepted + the model's own
                                 # one, fewer if a stop rule ended the sequence among them)

    def as_dict(self) -> dict:
        return {"num_draft_tokens": self.draft_tokens, "num_accepted_tokens": self.accepted_tokens,
                "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
                "mean_accepted_length": self.emitted_tokens / self.verify_steps if self.verify_steps else None,
                "num_verify_steps": self.verify_steps}


@dataclass
class SpeculativeDecoder:
    config: SpeculativeConfig
    max_model_len: int
    draft: object = None     # a DraftModel (draft_model.py) that fills the drafts in, or None (n-gram)
    records: dict[int, Acceptance] = field(default_factory=dict)   # seq_id -> its acceptance record
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    # ------------------------------------------------------------------ before the step
    def propose(self, groups: list[SequenceGroup], decoding: list[Sequence]) -> None:
        """Give each of ``decoding`` (sequences whose next step is a decode) its draft tokens,
        at most what its max_tokens and max_model_len leave room for. Beam searches do not
        speculate (their beams are chosen one step at a time)."""
        cfg = self.config
        row_cost = len(decoding) / (STEP_FIXED_ROWS + len(decoding))
        params_of = {s.seq_id: g.sampling_params for g in groups if g.beam is None for s in g.seqs}
        for seq in decoding:
            seq.draft_token_ids = []
            params = params_of.get(seq.seq_id)
            if params is None:
                continue
            # the step emits up to k + 1 tokens; the drafts' positions must stay < max_model_len
            room = min(params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
            record = self.records.setdefault(seq.seq_id, Acceptance())
            k = cfg.num_speculative_tokens
            if cfg.adaptive:
                k = best_draft_length(record.rate, k, row_cost)
            record.shadow = None
            if cfg.method == "draft_model":   # the length now; the draft model fills them in later
                record.idle_steps = 0 if k else record.idle_steps + 1
                if k == 0 and record.idle_steps >= PROBE_EVERY:
                    k, record.idle_steps = 1, 0
                seq.draft_token_ids = [DRAFT_PLACEHOLDER] * max(min(k, room), 0)
                continue
            guess = propose_ngram(seq.token_ids, max(k, 1), cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if seq.grammar is not None:   # structured outputs: only what the grammar would accept
                guess = guess[:seq.grammar.valid_prefix(guess)]
            if k == 0 or room <= 0:
                if guess:   # free to make: checked against what the model produces this step
                    record.shadow = (seq.num_output_tokens, guess[0])
                continue
            seq.draft_token_ids = guess[:min(k, room)]

    def fill_drafts(self, items: list, tables: list, block_size: int, sampler, generators: dict,
                    banned_of) -> dict[int, np.ndarray]:
        """After the schedule, before the pass: a draft model writes the drafts' tokens of the
        speculating ``items`` (their block ``tables`` map the drafts' slots). Returns each one's
        draft distributions (k, V) by seq_id, for sampled requests; n-gram drafts are already
        there (empty). ``banned_of(group, seq, ahead)``: the tokens banned that far ahead."""
        speculating = [(item, table) for item, table in zip(items, tables) if item.draft_token_ids]
        if self.draft is None or not speculating:
            return {}
        return self.draft.propose([i for i, _ in speculating], [t for _, t in speculating], block_size, sampler,
                                  generators, lambda item, ahead: banned_of(item.group, item.seq, ahead))

    # ------------------------------------------------------------------ the step's verdict
    def verify_rows(self, logits, offset: int, items: list, sampler, generators: dict, banned_of,
                    draft_probs: dict) -> tuple[list, int]:
        """Each speculating item's k + 1 rows of ``logits``, from row ``offset`` on, checked
        (``verify``): ([(item, drafts that stood, results to append)], the row after them).
        Nothing is changed yet: ``commit`` applies the verdicts once the whole step is computed."""
        verdicts = []
        for item in items:
            k = len(item.draft_token_ids)
            accepted, verified = self.verify(
                logits[offset:offset + k + 1], item.group, item.seq, list(item.draft_token_ids), sampler,
                generators[item.seq.seq_id], lambda ahead, g=item.group, s=item.seq: banned_of(g, s, ahead),
                draft_probs.get(item.seq.seq_id))
            verdicts.append((item, accepted, verified))
            offset += k + 1
        return verdicts, offset

    def commit(self, verdicts: list, append, block_manager, touched: dict) -> int:
        """Apply the step's verdicts: each item's drafts that stood and the model's own token are
        appended (``append(group, seq, result)``, until a stop rule fires), its progress moves past
        them, and the page table is rolled back past the rejected drafts (their slots unmapped,
        a block of rejected positions only freed at once). Returns the tokens emitted."""
        num_emitted = 0
        for item, accepted, verified in verdicts:
            seq = item.seq
            emitted = 0
            for result in verified:           # the drafts that stood, then the model's own token
                append(item.group, seq, result)
                emitted += 1
                if seq.is_finished():
                    break
            num_emitted += emitted
            self.record(seq, len(item.draft_token_ids), accepted, emitted)
            seq.num_computed_tokens = min(seq.num_computed_tokens + accepted, seq.num_tokens - 1)
            # the draft's pool keeps only the positions that stood
            seq.draft_num_computed_tokens = min(seq.draft_num_computed_tokens, seq.num_computed_tokens)
            if not seq.is_finished():         # unmap the rejected drafts' slots (page-table rollback)
                block_manager.rollback(seq, seq.num_computed_tokens)
            touched[item.group.request_id] = item.group
        return num_emitted

    def verify(self, logits, group: SequenceGroup, seq: Sequence, drafts: list[int], sampler,
               generator: np.random.Generator, banned,
               draft_probs: np.ndarray | None = None) -> tuple[int, list[SampleResult]]:
        """The target's logits (k + 1, V) at the newest token and each draft -> (drafts that
        stand, the results to append: those drafts and the target's own next token).
        ``banned(ahead)`` gives the tokens banned that many tokens further on; ``draft_probs``
        (k, V): the draft model's distributions (None: one-hot n-gram drafts)."""
        params = group.sampling_params
        k = len(drafts)
        # position i samples after the output and drafts[:i]: its own bans, penalties and grammar
        # mask (the grammar's state after drafts[:i], read ahead and rolled back)
        masks = seq.grammar.masks_ahead(drafts) if seq.grammar is not None else [None] * (k + 1)
        requests = [SampleRequest(params, generator, banned(i), seq.prompt_token_ids,
                                  seq.output_token_ids + drafts[:i], masks[i]) for i in range(k + 1)]
        adjusted = sampler.adjust(logits, requests)             # (k + 1, V) float32
        if params.greedy:
            verdict: Verdict = verify_greedy(to_host(adjusted.argmax(axis=-1)), drafts)
        else:
            probs = np.stack([to_host(shaped_probs(adjusted[i], params, sampler.xp)) for i in range(k + 1)])
            verdict = (verify_coupled(probs, drafts, generator) if draft_probs is None
                       else verify_sampled(probs, drafts, generator, draft_probs))
        n = len(verdict.token_ids)
        return verdict.num_accepted, sampler.results(logits[:n], verdict.token_ids, requests[:n])

    def record(self, seq: Sequence, k: int, accepted: int, emitted: int) -> None:
        """After a verdict's tokens were appended: ``accepted`` of ``k`` drafts stood (what the
        model agreed with: the rate the adaptive rule follows, and the acceptance counters);
        ``emitted`` tokens reached the output (fewer when a stop rule fired among them: the
        mean accepted length counts only those)."""
        record = self.records.setdefault(seq.seq_id, Acceptance())
        record.update(accepted, accepted + (accepted < k))    # tried: up to the first rejection
        self.stats.draft_tokens += k
        self.stats.accepted_tokens += accepted
        self.stats.verify_steps += 1
        self.stats.emitted_tokens += emitted

    def observe(self, seqs: list[Sequence]) -> None:
        """After a step: a guess made but not drafted (k = 0) is checked against the token the
        model produced, so a sequence's rate can rise again without paying for drafts."""
        for seq in seqs:
            record = self.records.get(seq.seq_id)
            if record is None or record.shadow is None:
                continue
            at, token = record.shadow
            record.shadow = None
            if seq.num_output_tokens > at:
                record.update(int(seq.output_token_ids[at] == token), 1)

    def forget(self, seq_id: int) -> None:
        self.records.pop(seq_id, None)
