"""Context parallelism: token layouts over shards (`balance`, `Layout`) and per-shard
plans for `sharded_attention`.
"""
