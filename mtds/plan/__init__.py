"""3D-layout planner: predicts memory and step time of (t, c, p, d, b, v, ZeRO, recompute, SP) layouts.

    from mtds.plan import ModelSpec, Workload, Cluster, get_gpu, evaluate, plan, predict, Candidate
See docs/planner.md for the formulas and their sources. Importing this package needs no torch
(only `mtds.plan.calibrate` does).
"""
from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster, GPUSpec, get_gpu
from mtds.plan.model_spec import ModelSpec, resolve_model
from mtds.plan.predict import Prediction, predict
from mtds.plan.search import PlanResult, evaluate, plan

__all__ = ["Candidate", "Workload", "Cluster", "GPUSpec", "get_gpu", "ModelSpec", "resolve_model",
           "Prediction", "predict", "PlanResult", "evaluate", "plan"]
