"""`RunOptions`: options of ``strategy.run``, with tf.distribute's names (plain data)."""
import dataclasses


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Options for ``strategy.run(fn, args, kwargs, options)``, as ``tf.distribute.RunOptions``.

    Every field keeps TensorFlow's name and default. A strategy honours a value or refuses
    it with a `ValueError` saying why; none is silently ignored:

    Attributes:
      experimental_enable_dynamic_batch_size: True (default): batches of any size run.
        Eager PyTorch always does this, so True is honoured everywhere; False (a
        static-shape promise) is honoured where every traced shape is compiled as it is
        (TPUStrategy), refused elsewhere.
      experimental_bucketizing_dynamic_shape: False (default). True asks TensorFlow's TPU
        compiler to pad dynamic shapes to buckets; torch_xla has no such pass: refused.
      experimental_xla_options: None (default). XLA compiler options; refused
        everywhere: strategies that do not compile with XLA have none, and torch_xla takes
        no per-run compiler options (XLA reads $XLA_FLAGS once).
      experimental_replicate_to_logical_devices: True (default). False (model
        parallelism over logical devices inside one replica) has no counterpart: refused.
    """

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: object = None
    experimental_replicate_to_logical_devices: bool = True


DEFAULT_RUN_OPTIONS = RunOptions()  # frozen: shared by every run without options


def check_run_options(options: RunOptions | None, strategy_name: str,
                      compiles_with_xla: bool = False) -> RunOptions:
    """Returns `options` (a `RunOptions`, None meaning the defaults) after refusing every
    value `strategy_name` cannot honour.

    `compiles_with_xla`: the strategy traces its step into XLA programs compiled for the
    shapes they see (TPUStrategy): ``experimental_enable_dynamic_batch_size=False`` is then
    honoured, and ``experimental_xla_options`` is refused for torch_xla's reason.

    Raises:
      TypeError: `options` is not a `RunOptions`.
      ValueError: a value that is not supported, naming it and what to do instead.
    """
    if options is None:
        return DEFAULT_RUN_OPTIONS
    if not isinstance(options, RunOptions):
        raise TypeError(f"options must be a ts.RunOptions (or None), got {options!r}.")
    if not options.experimental_enable_dynamic_batch_size and not compiles_with_xla:
        raise ValueError(
            "RunOptions(experimental_enable_dynamic_batch_size=False) is not supported: "
            "PyTorch runs every batch size as it comes, there is no static-shape mode to "
            "switch to. Leave it at True (the default).")
    if options.experimental_bucketizing_dynamic_shape:
        raise ValueError(
            "RunOptions(experimental_bucketizing_dynamic_shape=True) is not supported: "
            "torch_xla has no shape-bucketing pass. Pad batches to a few fixed sizes in "
            "the input pipeline instead (drop_last=True or a padding collate_fn).")
    if options.experimental_xla_options is not None:
        if compiles_with_xla:
            raise ValueError(
                "RunOptions(experimental_xla_options=...) cannot be honoured: torch_xla "
                "takes no compiler options per run; XLA reads its flags once, from the "
                "XLA_FLAGS environment variable, when its runtime starts. Set XLA_FLAGS "
                f"before creating the {strategy_name} and remove the option.")
        raise ValueError(
            f"RunOptions(experimental_xla_options=...) applies to TPUStrategy only; "
            f"{strategy_name} does not compile with XLA. Remove the option.")
    if not options.experimental_replicate_to_logical_devices:
        raise ValueError(
            "RunOptions(experimental_replicate_to_logical_devices=False) is not supported: "
            "torchstrategy has no logical devices (model parallelism inside a replica). "
            "Leave it at True (the default).")
    return options
