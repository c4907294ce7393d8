"""What every adapter's checks share: comparison rules, collective counting, TP shard values and ledgers."""
