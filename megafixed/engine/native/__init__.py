"""The torch-native implementation of the engine seam (``train.engine=torch``): FSDP2 data
parallelism (``fully_shard``; HSDP on a 2-D mesh; plain replication), DTensor tensor/sequence
parallelism (``parallelize_module``), ``torch.distributed.checkpoint`` and ``torch.compile``, on
one ``DeviceMesh``. It imports neither DeepSpeed nor megatron-core: a torch-only stack (and a
faster start). Named "native" because a package ``torch`` would shadow the library.

Its modules are reached through ``megafixed.engine`` (the dispatch on ``plan.engine``):
``support`` (what it refuses), ``mesh`` (the device mesh), ``materialize`` (single-process
initial values for any sharding), ``build`` (the model, its parallelisms and optimizer), ``engine``
(``NativeEngine``), ``step`` (one optimizer step, one evaluation pass).
"""
