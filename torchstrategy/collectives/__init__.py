"""Cross-replica communication: fused collectives, cross-device ops, the gradient reducer."""
