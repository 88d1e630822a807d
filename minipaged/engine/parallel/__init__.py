"""parallel: many processors, one kernel: the workers that hold the model's shards.

    worker.py            one processor and its local memory: a model shard and the KV pool of its
                         heads and layers, under the driver's one set of block ids
    executor.py          inter-processor calls: one step carried to every worker; ``uni`` runs them
                         in this process, their all-reduces a sum in lock step
    ray_executor.py      workers as Ray actors: pipeline stages pass hidden states as Ray objects,
                         tensor-parallel GPUs all-reduce over NCCL
"""
