"""Context parallelism: token layouts over shards (`balance`, `Layout`, MaxText's
`maxtext_layout`) and per-shard plans for `sharded_attention`.
"""

from maskc.parallel.maxtext import maxtext_layout as maxtext_layout

__all__ = ["maxtext_layout"]
