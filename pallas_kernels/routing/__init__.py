"""MoE router: logits -> (top-k expert ids, weights) under one ``RouterRule``, one launch.

``kernel.route`` is the Pallas (Triton lowering) implementation, ``reference.route_reference``
the plain-jnp one.
"""

from pallas_kernels.routing.config import RouterRule, Scoring, block_tokens
from pallas_kernels.routing.kernel import route
from pallas_kernels.routing.reference import route_reference

__all__ = ["RouterRule", "Scoring", "block_tokens", "route", "route_reference"]
