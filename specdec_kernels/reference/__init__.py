"""Plain-PyTorch reference implementations: the oracles every fast path is tested against.

Each reference has the same signature as the public op it checks and reads like
the paper it implements; speed is not a goal here.
"""
