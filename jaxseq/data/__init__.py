"""Data pipelines: GLUE tasks, text packing, seq2seq pairs, and fixed-shape batches."""
