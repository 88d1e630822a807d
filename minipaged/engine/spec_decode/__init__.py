"""spec_decode: speculative execution with rollback, in the memory manager's terms.

    decoder.py           SpeculativeDecoder: each sequence's draft length (the adaptive rule), n-gram
                         drafts, a draft model's drafts filled in, the verification of the step's
                         rows, and the commit: tokens appended, the page table rolled back past the
                         rejected drafts
    ngram_proposer.py    readahead for tokens: prompt-lookup drafts
    rejection_sampler.py retiring speculated work: greedy checks and the exact rejection rule
    draft_model.py       a draft model, its own KV pool under the target's block ids
"""
