"""A cell's data: examples tokenized and packed into training rows, drawn as micro-batches in a seeded order."""
