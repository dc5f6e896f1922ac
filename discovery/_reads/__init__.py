"""The read side: the watcher, its store and the routing table.

One copy of the watched records, and how fresh it is.
"""
