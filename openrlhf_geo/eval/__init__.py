"""Evaluation: avg@n, unbiased pass@k, paired multi-seed reports."""
