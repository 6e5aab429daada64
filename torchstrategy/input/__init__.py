"""Distributed input: splitting global batches over replicas, per-replica pipelines."""
