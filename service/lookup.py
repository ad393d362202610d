"""Prompt lookup: the drafts of a greedy stream's speculative step, taken from its own tokens, with no draft model.

A stream's next tokens often repeat a run of its prompt or of what it wrote (code, a summary quoting its input, a
list, a model stuck in a loop).  The drafts are what followed the stream's last tokens where they occurred
before: the longest suffix of its tokens, N_MAX tokens down to 1, found earlier in prompt and output, and the up to
k tokens after that place (vLLM's `ngram` speculator, llama.cpp's lookup decoding and OpenVINO GenAI's prompt lookup
propose the same way).  The decode batch (service/batch.py) runs the stream's token and the drafts in one call and
keeps what the model itself would have chosen, so the drafts decide only how much one call gives, never which tokens.
"""

from __future__ import annotations

import numpy as np

N_MAX = 3  # the longest suffix looked up


def drafts(tokens: np.ndarray, k: int, n_max: int = N_MAX) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest suffix of `tokens` (n_max down to 1 tokens)
    that occurs earlier: the latest with k tokens after it, else the first; none when no suffix occurs earlier.

    The places where the last token occurred before are found once (one comparison over the tokens); a longer
    suffix only narrows them, by the tokens before each place.  Every step of a speculating stream looks up, so it
    stays a few microseconds where a small model's step is well under a millisecond."""
    size = len(tokens)
    if size < 2:
        return []
    ends = np.flatnonzero(tokens[:size - 1] == tokens[size - 1])  # where an earlier occurrence would end
    for n in range(min(n_max, size - 1), 0, -1):
        at = ends[ends >= n - 1]
        for back in range(1, n):
            at = at[tokens[at - back] == tokens[size - 1 - back]]
        if len(at):
            hits = at - (n - 1)  # where each occurrence starts, in order
            whole = hits[hits + n + k <= size]  # places with k tokens after them (a loop shorter than k has some)
            start = int(whole[-1] if len(whole) else hits[0]) + n
            return [int(t) for t in tokens[start:start + k]]
    return []
