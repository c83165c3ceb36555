"""The input pipeline: ``sources`` (documents) -> ``tokenizer`` -> ``pipeline`` (batches)."""
