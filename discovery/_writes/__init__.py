"""The write side: leases, sessions, registrations and operators' actions.

Also each registration's watch of its own key and signal handling.
"""
