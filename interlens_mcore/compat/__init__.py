"""Adapters that let code written for other ecosystems drive this package unchanged.

`compat.swift`: ms-swift multi-turn schedulers and gym environments.
"""
