"""scheduler: the process scheduler.

    scheduler.py   FCFS continuous batching over three queues (waiting, running, swapped),
                   token and sequence budgets, preemption by swapping or by recomputation
                   (an OS paging out or killing its youngest process), chunked prefill,
                   multi-step decoding; each step returns a SchedulerOutput (the plan)

It asks the memory manager (memory/) for blocks and hands the engine a plan; like the
memory manager it imports only the standard library, so it is property-tested on its
own (tests/test_scheduler.py). The processes it schedules are minipaged/sequence.py.
"""
