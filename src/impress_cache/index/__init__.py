"""What a store knows about its prompts: the radix tree over token ids (`radix`, pure
Python) and the SQLite index that persists it with the chunk files' block tables
(`sqlite` and its statistics tables, `stats_tables`: the only modules that speak SQL)."""
