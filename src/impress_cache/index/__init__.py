"""What a store knows about its prompts: the radix tree over token ids (`radix`, pure
Python) and the SQLite index that persists it with the chunk files' block tables
(`sqlite`, the only module that speaks SQL)."""
