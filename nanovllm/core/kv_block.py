"""One KV block's bookkeeping, in either tier (core/block_manager.py, core/host_tier.py)."""


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "prefix_id", "parent_prefix_id",
                 "parent_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # -1: not a registered full block
        self.token_ids: tuple[int, ...] = ()
        # equal ids <=> equal token prefixes through this block, whatever the hashes say
        self.prefix_id = 0
        self.parent_prefix_id = 0  # prefix_id of the block before it; 0: the first block
        self.parent_hash: int | None = None  # hash of the block before it (cache events)
