"""The checks: registry and comparison rules, structure, collectives, TP shards, negative controls."""
