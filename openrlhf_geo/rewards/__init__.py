"""Reward functions (math-verify, ArmoRM) and reward-noise injection for robustness experiments."""
