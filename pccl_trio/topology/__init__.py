"""Topology: from measured links to ring orders (pure computation, no IO)."""

from ._solver import EXACT_LIMIT as EXACT_LIMIT
from ._solver import Ring as Ring
from ._solver import bottleneck_lower_bound as bottleneck_lower_bound
from ._solver import hop_costs as hop_costs
from ._solver import predicted_seconds as predicted_seconds
from ._solver import ring_of as ring_of
from ._solver import solve as solve
from ._solver import solve_exact as solve_exact
from ._solver import solve_heuristic as solve_heuristic
