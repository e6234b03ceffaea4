"""Schedule kernels from the target's tuning log (`mobilec tune`), where the tuned schedule measured faster than our
default rules; dlight then skips them (`tirx.is_scheduled`) and schedules the rest."""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from .. import tuning_log

TUNED_ATTR = "mobilec.tuning_record"  # on a kernel scheduled from the log: the record's key
FIX = "delete it, restore it from git, or compile with --no-tuning"


def _unscheduled(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: func for gv, func in mod.functions_items()
            if isinstance(func, tirx.PrimFunc) and not func.attrs.get("tirx.is_scheduled")}


@tvm.transform.module_pass(opt_level=0, name="ApplyTuningDatabase")
class ApplyTuningDatabase:
    """Applies tuning_logs/<target>/ (nothing when it is absent); runs inside `with target:`."""

    def __init__(self, target_name: str):
        self.directory = tuning_log.log_dir(target_name)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        database, applied = tuning_log.applied_records(self.directory, FIX)
        if not applied:
            return mod
        before = _unscheduled(mod)
        with database:
            mod = relax.transform.MetaScheduleApplyDatabase()(mod)
        after = _unscheduled(mod)
        for name, func in before.items():
            if name not in after:
                gv = mod.get_global_var(name)
                mod[gv] = mod[gv].with_attr(TUNED_ATTR, applied[tuning_log.workload_key(func)])
        return mod


def tuned_kernels(mod: tvm.IRModule) -> list[str]:
    """The kernels ApplyTuningDatabase scheduled from the log."""
    return sorted(gv.name_hint for gv, func in mod.functions_items()
                  if isinstance(func, tirx.PrimFunc) and TUNED_ATTR in func.attrs)
