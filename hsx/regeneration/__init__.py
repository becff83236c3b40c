"""Regeneration: the target model rewrites a dataset's assistant turns, turn by turn, into a
dataset `hsx extract` reads with the exact token ids the engine produced."""
