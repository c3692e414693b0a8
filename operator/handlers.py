"""The operator's kopf handlers, registered by importing the modules that declare them (``kopf
run -m cadenza.operator.handlers``; ``cadenza operator`` imports this module too):

- :mod:`.startup`: login, kopf's settings, the shared API client, tracing;
- :mod:`.children`: kopf's indexes of the pools and of their children;
- :mod:`.converge`: create / update / resume of a ServingPool;
- :mod:`.resync`: the operator's state (``memo.operator``) and its resync loop.
"""

from cadenza.operator import children, converge, resync, startup  # noqa: F401 - each registers its handlers
