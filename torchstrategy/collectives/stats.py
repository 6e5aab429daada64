"""`ReductionStats`: what the gradient reducer did in the last synchronised backward."""
import typing


class ReductionStats(typing.NamedTuple):
    """Statistics of the last synchronised ``backward()`` (``strategy.extended.stats()``).

    Attributes:
      bytes_reduced: bytes handed to all-reduce: every bucket's buffer in the dtype it
        travelled in (bf16/fp16 under compression), and the step's "contributed" flags
        (one float32 per parameter, all-reduced beside the buckets). Each replica sends
        and receives about twice this over a ring.
      num_buckets: all-reduce collectives launched (one per bucket).
      num_parameters: parameters the reducer synchronises.
      exposed_communication_seconds: time spent after backward's computation waiting for
        the all-reduces to finish (communication not hidden behind backward).
      compression: the wire format ("bf16", "fp16") or None.
      steps: synchronised backward passes so far.
      compression_ratio: under error-feedback compression (ts.PowerSGD, ts.Int8), the
        buckets' bytes over the bytes sent; 1.0 otherwise.
      bucket_cap_bytes: the largest bucket now (`ts.BucketAutotuner` may have chosen it).
    """

    bytes_reduced: int = 0
    num_buckets: int = 0
    num_parameters: int = 0
    exposed_communication_seconds: float = 0.0
    compression: typing.Optional[str] = None
    steps: int = 0
    compression_ratio: float = 1.0
    bucket_cap_bytes: int = 0
