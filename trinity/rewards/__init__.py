"""Reward functions: the built-ins, the loader of user functions, and the process a job scores in."""
