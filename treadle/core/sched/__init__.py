"""The scheduler and the queue policies. Importing the package registers the built-in policies,
in the order --policy's help lists them."""

from treadle.core.sched import fcfs, priority, fair, deadline  # noqa: F401, I001
