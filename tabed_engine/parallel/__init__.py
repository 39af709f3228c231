"""Tensor parallelism for the target model: sharding by the `Linear.parallel` marks
(shard.py), one rank's shard loaded straight from the checkpoint (load.py), the group and its
collectives (comm.py). See docs/parallel.md."""
