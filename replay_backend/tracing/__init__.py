"""Trace: how a model reaches Dynamo (the token dimension dynamic from the first call) and
the replay boundary markers it puts in the traced graph."""
