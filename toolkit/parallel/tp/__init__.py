"""Tensor parallelism, re-exported: the TP and data-parallel groups of the mesh (`groups.make_layout`),
the layers (`layers.py`) on their conjugate collectives (`comm.py`), and the plan read from the model's
`base_model_tp_plan` and applied (`plan.py`; `toolkit.layout.tp_regions` is its torch-free reading of
the config, for the rules and the planner). How any parameter was cut, TP or EP, and the full state dict
gathered back: `toolkit.parallel.cut`; what a run's cut holds: `toolkit.parallel.parallelize.Parallelized`."""

from toolkit.parallel.cut import full_state_dict
from toolkit.parallel.tp.groups import Layout, make_layout
from toolkit.parallel.tp.plan import apply_tensor_parallel

__all__ = ["Layout", "make_layout", "apply_tensor_parallel", "full_state_dict"]
