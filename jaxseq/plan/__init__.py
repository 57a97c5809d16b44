"""Ahead-of-time plans: compile a step for a Cloud TPU slice you do not have, and say whether it fits and how fast.

    topo = topology("v5e-8")                                  # abstract devices + chip specs
    mesh = make_mesh("fsdp=8", devices=topo.devices)
    lowered = jax.jit(step, in_shardings=..., out_shardings=..., donate_argnums=...).lower(*abstract_args)
    plan = compile_plan(lowered, topo, parameters=p, optimizer_state=o, batch=b, model_flops=flops)
    print(format_table(plan)); write_plan("plan.json", plan)
    if not plan["fits"]: raise JaxseqError(refusal(plan))

Memory comes from the compiler (what libtpu itself checks), the step time from a roofline over the compiled HLO.
Needs libtpu (``pip install 'jaxseq[tpu]'``); nothing runs on a TPU. One concern a module: ``chips`` (chips and
slices), ``hlo`` (the compiled program's cost), ``buffers`` (what holds memory at its peak), ``compile`` (the
plan), ``report`` (its table, file and refusal), ``search`` (``--plan_search``: layouts ranked, then compiled).
"""

from jaxseq.plan.chips import CHIPS, Topology, topology
from jaxseq.plan.compile import compile_plan
from jaxseq.plan.report import format_table, refusal, write_plan

__all__ = ["CHIPS", "Topology", "compile_plan", "format_table", "refusal", "topology", "write_plan"]
