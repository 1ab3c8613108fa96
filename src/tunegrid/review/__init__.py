"""What a person reads, built from the files alone: the summary table, the recommendations and the report."""
