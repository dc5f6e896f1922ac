"""Routing: the router and everything it decides with.

Policies, admission, loss protection, fencing, splits, prefill/decode pairs, and the fleet
client that sends requests where the router picks.
"""
