"""The prefix cache under changing weights: an engine's requests share KV blocks only with requests of the same
weights.

vLLM caches every full KV block under a hash of its tokens (chained over the blocks before it), so a prompt whose
head matches cached blocks (a system prompt, a chat template's head, a shared problem statement) reuses their KV
instead of computing it. After a weight update those blocks hold the older weights' KV. vLLM 0.32's
``reset_prefix_cache()`` forgets them only while no block is in use (it returns False and changes nothing
otherwise), and while responses stream across an update some block always is. So instead every request carries a
``cache_salt`` (vLLM's per-request namespace: it enters the first block's hash, hence every later one) naming the
weights the engine held when the request was added (`WeightEpoch`). Requests of one weight version still share
prefixes, and none ever reads a block that another set of weights computed. A request added before an update that has
not produced a token yet must not start under its old salt: the stream restarts it under the new one
(vllm_stream.py). The blocks of older salts are never hit again; they stay in vLLM's free queue, evicted as
space is needed, like any cached block.
"""

from __future__ import annotations


class WeightEpoch:
    """The weight loads of one engine: each successful load opens a new prefix-cache namespace."""

    def __init__(self) -> None:
        self.loads = 0

    def advance(self) -> None:
        """The engine now computes with new weights: requests added from here on read only blocks of this load."""
        self.loads += 1

    @property
    def salt(self) -> str:
        return f"weights-{self.loads}"  # vLLM refuses '@', '/', '\\' and NUL in a salt

    def prompt(self, token_ids: list[int]) -> dict:
        """vLLM's token prompt, in this load's namespace."""
        return {"prompt_token_ids": list(token_ids), "cache_salt": self.salt}
