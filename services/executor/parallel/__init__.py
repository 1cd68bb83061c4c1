"""Tensor parallelism: how a group of executor ranks shards the model and exchanges tensors.

- ``base``: the ``Communicator`` interface every transport implements (``all_reduce``,
  ``all_reduce_``, ``gather``, ``barrier``, ``close``), ``GroupError`` and ``SingleRank``.
- ``shm``: same host, CPU tensors, through named POSIX shared-memory segments (``segment``).
- ``cuda_ipc``: same host, GPU tensors, through CUDA IPC memory handles (flags in shared memory).
- ``torch_dist``: across hosts, ``torch.distributed`` (gloo on CPU, NCCL on GPU).
- ``rendezvous``: the start-up handshake that swaps the ranks' handle bytes through a store.
- ``group``: ``open_group(GroupConfig)``, the one call an executor rank makes to get its communicator.
- ``sharding``: which heads, KV heads, MLP columns and vocabulary rows each rank holds.
"""
